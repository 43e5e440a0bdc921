"""Hostile ``.lum`` programs for the Lumen fuzzer (``test_lumen_fuzz.py``).

``cases(rng)`` yields ``(name, text)``: grammar-aware mutations of the repository's family
files — their tokens (lark's lexer) deleted, repeated, swapped or replaced by another token
of the same terminal or by a hostile value (huge or non-finite numbers, tensor names with
``..``, negative dims) — statements wrapped in huge loops or recursion, and expressions
replaced by the pathological shapes of issue 25 (thousands of nested ``-``, ``not``, ``if``,
call arguments, a 20,000-term sum). Every case must end as a graph or a located DynaError.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from dynalm.ir.lumen.syntax import _parser
from dynalm.models.arch import ARCH_DIR

Token = tuple[str, str, int, int]  # terminal, text, start, end

NUMBERS = [
    "0", "1", "-1", "2", "64", "9223372036854775807", "9223372036854775808", "9" * 5000,
    "1e999", "1e-999", "0.0", "1e308", "4294967296", "1000000000", "10000",
]  # fmt: skip
STRINGS = ['"blk..weight"', '"../x"', '""', '"{i}{i}{i}"', '"' + "x" * 5000 + '"', '"{nope}"']
WEIGHTS = ['w"blk..weight"', 'w?"../x"', 'w""', 'w"token_embd.weight"', 'w?"blk.{i}..x"']
KEYWORDS = [
    "fn", "let", "for", "in", "..", "if", "then", "else", "return", "output", "forward",
    "param", "input", "family", "not", "and", "or", "{", "}", "(", ")", "[", "]", ",", ":",
    "=", "->", "<", ">", "?", "-", "+", "*", "/", "//", "%", "==", "true", "false",
]  # fmt: skip


def deep(kind: str, n: int) -> str:
    """An expression nested ``n`` deep (issue 25's shapes)."""
    return {
        "neg": "-" * n + "1",
        "not": "not " * n + "true",
        "sum": " + ".join(["1"] * n),
        "if": "if true then " * n + "1" + " else 2" * n,
        "call": "sqrt(" * n + "4" + ")" * n,
        "paren": "(" * n + "1" + ")" * n,
    }[kind]


def family_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(ARCH_DIR.glob("*.lum"))}


def tokens(text: str) -> list[Token]:
    return [(t.type, str(t), t.start_pos, t.end_pos) for t in _parser().lex(text)]


def _splice(text: str, toks: list[Token], i: int, new: str, j: int | None = None) -> str:
    """``text`` with tokens ``i`` .. ``j`` (inclusive; default ``i``) replaced by ``new``."""
    j = i if j is None else j
    return text[: toks[i][2]] + new + text[toks[j][3] :]


def _same_kind(rng: random.Random, toks: list[Token], i: int) -> str:
    kind = toks[i][0]
    pool = {"NUMBER": NUMBERS, "STRING": STRINGS, "WEIGHT": WEIGHTS}.get(kind)
    if pool and rng.random() < 0.7:
        return rng.choice(pool)
    return rng.choice([t[1] for t in toks if t[0] == kind])


Mutation = Callable[[random.Random, str, list[Token]], tuple[str, str]]


def _delete(rng, text, toks):
    i = rng.randrange(len(toks))
    return f"delete {toks[i][1]!r}", _splice(text, toks, i, "")


def _repeat(rng, text, toks):
    i = rng.randrange(len(toks))
    return f"repeat {toks[i][1]!r}", _splice(text, toks, i, toks[i][1] + " " + toks[i][1])


def _swap(rng, text, toks):
    i = rng.randrange(len(toks) - 1)
    a, b = toks[i][1], toks[i + 1][1]
    return f"swap {a!r} {b!r}", _splice(text, toks, i, f"{b} {a}", i + 1)


def _replace_same(rng, text, toks):
    i = rng.randrange(len(toks))
    new = _same_kind(rng, toks, i)
    return f"replace {toks[i][1]!r} by {new[:20]!r}", _splice(text, toks, i, new)


def _replace_keyword(rng, text, toks):
    i = rng.randrange(len(toks))
    new = rng.choice(KEYWORDS)
    return f"replace {toks[i][1]!r} by {new!r}", _splice(text, toks, i, new)


def _deep_operand(rng, text, toks):
    """An operand (a number or a name) replaced by a deeply nested expression."""
    i = rng.choice([k for k, t in enumerate(toks) if t[0] in ("NUMBER", "NAME")])
    kind, n = rng.choice(["neg", "not", "sum", "if", "call", "paren"]), rng.choice([50, 200, 5000])
    return f"{kind} x{n} for {toks[i][1]!r}", _splice(text, toks, i, f"({deep(kind, n)})")


def _huge_loop(rng, text, toks):
    """A loop bound (``..`` hi) replaced by a huge or absurd value."""
    dots = [k for k, t in enumerate(toks) if t[1] == ".." and k + 1 < len(toks)]
    if not dots:
        return _replace_same(rng, text, toks)
    i = rng.choice(dots) + 1
    new = rng.choice(["1000000000", "10000", "9" * 40, "-5", "n_layers * n_layers * 1000"])
    return f"loop to {new[:20]}", _splice(text, toks, i, new)


def _truncate(rng, text, toks):
    cut = rng.randrange(len(text))
    return f"truncate at {cut}", text[:cut]


def _garbage(rng, text, toks):
    at = rng.randrange(len(text))
    junk = rng.choice(["\x00", "\u00b2", "\u0663", "\ud7ff", "\t" * 3, "{" * 3000, "#\n", "\\"])
    return f"insert {junk[:4]!r} at {at}", text[:at] + junk + text[at:]


MUTATIONS: list[Mutation] = [
    _delete, _repeat, _swap, _replace_same, _replace_same, _replace_keyword, _deep_operand,
    _huge_loop, _truncate, _garbage,
]  # fmt: skip

HEAD = "family llama\ninput tokens: tensor<i32, [T]>\n"
TAIL = '    output logits = embed(tokens, w"token_embd.weight")\n}\n'
FIB = "fn f(n: int) -> int {\n if n < 2 { return n }\n return f(n - 1) + f(n - 2)\n}\n"

# Issue 25's pathological programs, whole.
SHAPES: dict[str, str] = {
    **{
        f"{kind}-{n}": f"{HEAD}param p: float = {deep(kind, n)}\nforward {{\n{TAIL}"
        for kind, n in [("neg", 5000), ("not", 5000), ("sum", 20000), ("if", 3000), ("call", 3000)]
    },
    "if-blocks-3000": f"{HEAD}forward {{\n{'if true {' * 3000}{'}' * 3000}\n{TAIL}",
    "loop-1e9": f"{HEAD}forward {{\nfor i in 0 .. 1000000000 {{ let a = i }}\n{TAIL}",
    "loops-10000x10000": (
        f"{HEAD}forward {{\nfor i in 0 .. 10000 {{ for j in 0 .. 10000 {{ let a = j }} }}\n{TAIL}"
    ),
    "loop-huge-bound": f"{HEAD}forward {{\nfor i in 0 .. {'9' * 50} {{ let a = i }}\n{TAIL}",
    "exponential-recursion": f"{HEAD}{FIB}forward {{\nlet a = f(60)\n{TAIL}",
    "recursion-in-param": f"{HEAD}{FIB}param p: int = f(60)\nforward {{\n{TAIL}",
    "literal-5000-digits": f"{HEAD}param p: int = {'9' * 5000}\nforward {{\n{TAIL}",
    "sqrt-huge": f"{HEAD}param p: float = sqrt({'9' * 400})\nforward {{\n{TAIL}",
    "float-param-huge": f"{HEAD}param p: float = {'9' * 400}.5\nforward {{\n{TAIL}",
    "format-huge": (
        f'{HEAD}param q: int = 4611686018427387904 * 2\nparam p: str = "{{q}}"\nforward {{\n{TAIL}'
    ),
    "negative-dim": f"{HEAD}input x: tensor<f32, [-3]>\nforward {{\n{TAIL}",
    "absurd-dim": f"{HEAD}input x: tensor<f32, [T, 99999999999999]>\nforward {{\n{TAIL}",
    "dotdot-weight": f'{HEAD}forward {{\nlet w = w"blk..weight"\n{TAIL}',
}


def cases(rng: random.Random, n: int) -> Iterator[tuple[str, str]]:
    """``n`` mutants of the family files (each 1 to 3 mutations deep)."""
    texts = family_texts()
    for k in range(n):
        name = rng.choice(sorted(texts))
        text, steps = texts[name], []
        for _ in range(rng.choice([1, 1, 2, 3])):
            try:
                toks = tokens(text)
            except Exception:  # the lexer refuses a mutant's text: mutate it no further
                break
            if len(toks) < 2:
                break
            what, text = rng.choice(MUTATIONS)(rng, text, toks)
            steps.append(what)
        yield f"#{k} {name}: {'; '.join(steps)}", text


def shapes() -> Iterator[tuple[str, str]]:
    yield from SHAPES.items()
