"""A structural PTX checker: what CI can say of PTX without ``ptxas`` or a GPU.

It parses PTX as LLVM's NVPTX target writes it (one statement per line) and checks:

* the module header: ``.version M.N``, ``.target sm_XX``, ``.address_size 32|64``, in
  that order, before anything else;
* each function (``.entry``, or ``.func`` with optional return parameters): a name, a
  parenthesised list of well-formed ``.param`` declarations, a body in balanced braces
  (nested scopes allowed); ``.extern`` declarations end in ``;``;
* in a body, every line is a brace, a label (``NAME:``), a declaration or an instruction
  ending in ``;`` (its operand list may go on over lines that begin with an operand,
  ``{%r1,`` or ``%r1,``, as LLVM writes ``mma``'s); registers are declared with ``.reg``
  (``%r<N>`` declares ``%r0`` .. ``%r{N-1}``) before use, or are special registers;
  every opcode (the part before the first ``.``) is a PTX instruction of ``OPCODES``;
  branch targets are labels of the same function; names in ``[...]`` are declared
  parameters, locals or module variables.

It is not ``ptxas``: types of operands against opcodes, instruction availability per
``.target`` and resource limits are not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OPCODES = frozenset(
    [
        "abs",
        "activemask",
        "add",
        "addc",
        "alloca",
        "and",
        "applypriority",
        "atom",
        "bar",
        "barrier",
        "bfe",
        "bfi",
        "bfind",
        "bmsk",
        "bra",
        "brev",
        "brkpt",
        "call",
        "clz",
        "cnot",
        "copysign",
        "cos",
        "cp",
        "createpolicy",
        "cvt",
        "cvta",
        "discard",
        "div",
        "dp2a",
        "dp4a",
        "elect",
        "ex2",
        "exit",
        "fence",
        "fma",
        "fns",
        "getctarank",
        "griddepcontrol",
        "isspacep",
        "istypeof",
        "ld",
        "ldmatrix",
        "ldu",
        "lg2",
        "lop3",
        "mad",
        "mad24",
        "madc",
        "mapa",
        "match",
        "max",
        "mbarrier",
        "membar",
        "min",
        "mma",
        "mov",
        "movmatrix",
        "mul",
        "mul24",
        "multimem",
        "nanosleep",
        "neg",
        "not",
        "or",
        "pmevent",
        "popc",
        "prefetch",
        "prefetchu",
        "prmt",
        "rcp",
        "red",
        "redux",
        "rem",
        "ret",
        "rsqrt",
        "sad",
        "selp",
        "set",
        "setmaxnreg",
        "setp",
        "shf",
        "shfl",
        "shl",
        "shr",
        "sin",
        "slct",
        "sqrt",
        "st",
        "stackrestore",
        "stacksave",
        "stmatrix",
        "sub",
        "subc",
        "suld",
        "suq",
        "sured",
        "sust",
        "tanh",
        "testp",
        "tex",
        "tld4",
        "trap",
        "txq",
        "vabsdiff",
        "vadd",
        "vmad",
        "vmax",
        "vmin",
        "vote",
        "vset",
        "vshl",
        "vshr",
        "vsub",
        "wgmma",
        "wmma",
        "xor",
    ]
)
SPECIAL = frozenset(
    [
        "tid",
        "ntid",
        "ctaid",
        "nctaid",
        "laneid",
        "warpid",
        "nwarpid",
        "smid",
        "nsmid",
        "gridid",
        "clock",
        "clock64",
        "lanemask_eq",
        "lanemask_le",
        "lanemask_lt",
        "lanemask_ge",
        "lanemask_gt",
        "pm0",
        "pm1",
        "pm2",
        "pm3",
        "globaltimer",
        "dynamic_smem_size",
        "total_smem_size",
        "envreg",
    ]
)
_NAME = r"[A-Za-z_$][\w$]*"
_TYPE = r"\.(?:[usbf](?:8|16|32|64)|b128|pred|f16x2|bf16|bf16x2)"
_PARAM = re.compile(
    rf"\.param\s+(?:\.align\s+\d+\s+)?{_TYPE}"
    rf"(?:\s+\.ptr(?:\s+\.(?:global|shared|const|local))?\s+\.align\s+\d+)?"
    rf"\s+({_NAME})(?:\[\d+\])?$"
)
_FUNC = re.compile(
    rf"^(?:\.(?:visible|weak|extern)\s+)*\.(entry|func)\s*(?:\((.*?)\)\s*)?({_NAME})\s*\((.*)\)"
    rf"((?:\s*\.(?:maxntid|reqntid|minnctapersm|maxnreg|noreturn)[^{{;]*)*)$",
    re.S,
)
_REG_DECL = re.compile(rf"^\.reg\s+{_TYPE}\s+(.+)$")
_VAR_DECL = re.compile(
    rf"^(?:\.(?:visible|extern|weak)\s+)*\.(?:local|shared|global|const|param)\s+"
    rf"(?:\.align\s+\d+\s+)?{_TYPE}\s+({_NAME})(?:\[\d*\])*(?:\s*=.*)?$",
    re.S,
)
_REG_USE = re.compile(r"%([A-Za-z_][A-Za-z_]*?)(\d*)(?:\.[xyzw])?\b")
_LABEL = re.compile(rf"^({_NAME}):$")
_ADDRESS = re.compile(rf"\[\s*({_NAME})\s*(?:[+-]\s*\d+)?\s*\]")


class PtxError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"PTX line {line}: {message}")
        self.line = line


@dataclass
class Function:
    kind: str  # "entry" or "func"
    name: str
    params: list[str]
    instructions: int = 0
    opcodes: set[str] = field(default_factory=set)


@dataclass
class Summary:
    version: str
    target: str
    address_size: int
    functions: list[Function]

    @property
    def entries(self) -> list[str]:
        return [f.name for f in self.functions if f.kind == "entry"]


_OPERAND_LINE = re.compile(r"\{?%\w")  # a continued operand list: "{%r1, ..." or "%r1, ..."


def _lines(ptx: str) -> list[tuple[int, str]]:
    """(line number, text) without comments and blank lines."""
    ptx = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), ptx, flags=re.S)
    out = []
    for n, line in enumerate(ptx.splitlines(), 1):
        line = line.split("//", 1)[0].strip()
        if line:
            out.append((n, line))
    return out


def check(ptx: str) -> Summary:
    """Parse ``ptx`` and return what it defines; raises ``PtxError`` naming the line."""
    lines = _lines(ptx)
    header = []
    for directive, pattern in (
        (".version", r"\.version\s+(\d+\.\d+)"),
        (".target", r"\.target\s+(sm_\d+[a-z]?(?:\s*,\s*\w+)*)"),
        (".address_size", r"\.address_size\s+(32|64)"),
    ):
        if not lines:
            raise PtxError(0, f"missing {directive}")
        n, text = lines.pop(0)
        m = re.fullmatch(pattern, text)
        if not m:
            raise PtxError(n, f"expected {directive}, found {text!r}")
        header.append(m.group(1))
    module_vars: set[str] = set()
    functions: list[Function] = []
    i = 0
    while i < len(lines):
        n, text = lines[i]
        var = _VAR_DECL.match(text.rstrip(";"))
        if var and text.endswith(";"):
            module_vars.add(var.group(1))
            i += 1
            continue
        # a function header runs until its body's "{" (or ";" for a declaration)
        j, head = i, []
        while j < len(lines) and lines[j][1] not in ("{",) and not lines[j][1].endswith(";"):
            head.append(lines[j][1])
            j += 1
        if j >= len(lines):
            raise PtxError(n, "function header without a body")
        declaration = lines[j][1].endswith(";")
        if declaration:
            head.append(lines[j][1][:-1])
        fn = _function(n, " ".join(head))
        if declaration:
            if ".extern" not in head[0]:
                raise PtxError(n, f"{fn.name}: declaration without .extern")
            module_vars.add(fn.name)
            i = j + 1
            continue
        module_vars.add(fn.name)
        i = _body(lines, j, fn, module_vars)
        functions.append(fn)
    if not functions:
        raise PtxError(len(ptx.splitlines()), "no function defined")
    return Summary(header[0], header[1], int(header[2]), functions)


def _function(n: int, head: str) -> Function:
    m = _FUNC.match(head)
    if not m:
        raise PtxError(n, f"malformed function header {head[:80]!r}")
    kind, ret, name, params = m.group(1), m.group(2), m.group(3), m.group(4)
    names = []
    for group in (ret, params):
        for p in filter(None, (p.strip() for p in (group or "").split(","))):
            pm = _PARAM.match(p)
            if not pm:
                raise PtxError(n, f"{name}: malformed parameter {p!r}")
            names.append(pm.group(1))
    if kind == "entry" and ret:
        raise PtxError(n, f"{name}: an .entry returns nothing")
    return Function(kind, name, names)


def _body(lines: list[tuple[int, str]], start: int, fn: Function, module_vars: set[str]) -> int:
    """Check the body opening at ``lines[start]`` ("{"); returns the index after it."""
    regs: dict[str, int | None] = {}  # name -> count of an indexed range, None: one register
    symbols = set(fn.params) | module_vars
    labels: set[str] = set()
    targets: list[tuple[int, str]] = []
    depth, i = 0, start
    while True:
        if i >= len(lines):
            raise PtxError(lines[-1][0], f"{fn.name}: unbalanced braces (missing '}}')")
        n, text = lines[i]
        i += 1
        if text == "{":
            depth += 1
            continue
        if text == "}":
            depth -= 1
            if depth == 0:
                break
            continue
        if _LABEL.match(text):
            labels.add(text[:-1])
            continue
        # an instruction whose operand list goes on over lines (LLVM writes mma's
        # vector operands one a line: "{%r1, %r2}," ... "{%r3};")
        while not text.endswith(";") and i < len(lines) and _OPERAND_LINE.match(lines[i][1]):
            text = f"{text} {lines[i][1]}"
            i += 1
        if not text.endswith(";"):
            raise PtxError(n, f"{fn.name}: statement does not end in ';': {text!r}")
        stmt = text[:-1].strip()
        if stmt.startswith(".reg"):
            m = _REG_DECL.match(stmt)
            if not m:
                raise PtxError(n, f"{fn.name}: malformed .reg {stmt!r}")
            for reg in m.group(1).split(","):
                rm = re.fullmatch(r"%([A-Za-z_]\w*?)(?:<(\d+)>)?", reg.strip())
                if not rm:
                    raise PtxError(n, f"{fn.name}: malformed register {reg.strip()!r}")
                regs[rm.group(1)] = int(rm.group(2)) if rm.group(2) else None
            continue
        if stmt.startswith("."):
            var = _VAR_DECL.match(stmt)
            if var:
                symbols.add(var.group(1))
            elif not stmt.startswith(".pragma"):
                raise PtxError(n, f"{fn.name}: unknown directive {stmt.split()[0]!r}")
            continue
        _instruction(n, stmt, fn, regs, symbols, targets)
    if depth != 0:
        raise PtxError(n, f"{fn.name}: unbalanced braces")
    for n, label in targets:
        if label not in labels:
            raise PtxError(n, f"{fn.name}: branch to undefined label {label}")
    return i


def _instruction(
    n: int,
    stmt: str,
    fn: Function,
    regs: dict[str, int | None],
    symbols: set[str],
    targets: list[tuple[int, str]],
) -> None:
    guard = re.match(r"@!?%(\w+)\s+", stmt)
    body = stmt[guard.end() :] if guard else stmt
    parts = body.split(None, 1)
    opcode, operands = parts[0], parts[1] if len(parts) > 1 else ""
    base = opcode.split(".", 1)[0]
    if base not in OPCODES:
        raise PtxError(n, f"{fn.name}: unknown opcode {opcode!r}")
    fn.instructions += 1
    fn.opcodes.add(opcode)
    for m in _REG_USE.finditer(stmt):
        name, index = m.group(1), m.group(2)
        if name in SPECIAL and not index:
            continue
        if name not in regs:
            raise PtxError(n, f"{fn.name}: register %{name}{index} used before a .reg")
        count = regs[name]
        if count is None and index:
            raise PtxError(n, f"{fn.name}: %{name}{index}: %{name} is one register")
        if count is not None and (not index or int(index) >= count):
            raise PtxError(n, f"{fn.name}: %{name}{index} outside %{name}<{count}>")
    for m in _ADDRESS.finditer(operands):
        if m.group(1) not in symbols:
            raise PtxError(n, f"{fn.name}: address of undeclared {m.group(1)}")
    if base == "bra":
        targets.append((n, operands.strip()))
    elif base == "mov":
        src = operands.rsplit(",", 1)[-1].strip()
        if re.fullmatch(_NAME, src) and src not in symbols:
            raise PtxError(n, f"{fn.name}: mov of undeclared {src}")
