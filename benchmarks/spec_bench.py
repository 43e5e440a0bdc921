"""Speculative decoding on SmolLM2-135M Q4_1, side by side in one run (2 threads).

1. Step time for T = 1..16 tokens of one sequence (what decides the draft length).
2. Single stream, greedy decode speed (tg: generated tokens after the first / time),
   without a drafter and with n-gram drafting, runs alternating: copy-heavy prompts
   (edit this code, repeat with changes, extract quotes, repeat a paragraph or a list) and
   open-ended chat; with ``--answers`` each request ends where the model ends its answer
   (at most ``--tokens``), as a user's short request does.
3. 8 concurrent streams (copy-heavy and chat mixed): aggregate tokens/s, started together
   (a closed batch: it ends with its slowest stream), and 8 seats with 21 requests queued
   behind them (a server's steady state: every token over the whole run's time); and the
   8 streams on two plain engines compared the same way ("A/A": the machine's noise).
4. Draft models: the target as its own draft (acceptance must be 100 %: the plumbing) and
   the layer-skipping self-draft (its honest acceptance and speed).

Every speculative run's tokens are checked against the plain run's (greedy: identical).

    PYTHONPATH=src python benchmarks/spec_bench.py [MODEL.gguf] [--runs 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.engine.scheduler import Request, ScheduledChunk, flat_batch
from dynalm.runtime.engine.spec_decode.drafters import Drafter, ModelDrafter, NgramDrafter

DEFAULT_MODEL = ".models/models/smollm2/135m/SmolLM2-135M-Instruct.Q4_1.gguf"

CODE = """def load_config(path):
    with open(path) as f:
        lines = f.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    with open(path, "w") as f:
        for key, value in sorted(config.items()):
            f.write(f"{key} = {value}\\n")
"""
STORY = (
    'The lighthouse keeper, Ada Morrow, wrote in her log every evening. "The sea was calm '
    'today and the gulls stayed near the rocks," she wrote on Monday. On Tuesday a storm '
    'came from the west. "I have never seen waves so tall," she told the harbour master, '
    '"they broke over the lamp room twice before midnight." The harbour master replied, '
    '"Keep the light burning and stay inside until it passes." By Thursday the weather '
    'cleared, and a fishing boat returned with its nets full. "We owe our lives to that '
    'light," said the captain, shaking her hand.'
)
SETTINGS = """server = {
    "host": "127.0.0.1",
    "port": 8000,
    "workers": 4,
    "timeout": 30,
    "log_level": "info",
    "log_file": "/var/log/app.log",
    "max_upload_mb": 16,
    "allowed_origins": ["https://example.com", "https://api.example.com"],
    "database_url": "postgres://app@localhost/app",
    "cache_ttl": 300,
}
"""
COPY_PROMPTS = {
    # SmolLM2-135M rewrites this function's body instead of copying it: few drafts survive
    "edit code": f"Rename the function load_config to read_config everywhere in this code and "
    f"show the whole code:\n\n{CODE}",
    # an edit whose answer is mostly the given code (the 135M model copies it, rename or not)
    "rename, whole code": f"```python\n{SETTINGS}```\n\nRename `server` to `settings` and "
    "reply with the whole code.",
    "repeat with changes": "Repeat the following list exactly, but replace every 'red' with "
    "'blue':\n\n1. The red car is parked near the red house.\n2. A red bird sat on the "
    "fence next to the red barn.\n3. She wore a red scarf and red gloves to the market.\n"
    "4. The red apples in the basket were sweet and fresh.\n5. Paint the red door and the "
    "red window frames before winter.",
    "extract quotes": f"Extract every sentence in quotation marks from this text, one per "
    f"line, with who said it:\n\n{STORY}",
    "repeat paragraph": "Repeat the following paragraph exactly, word for word:\n\nThe "
    "history of the Roman Empire begins with the founding of the city of Rome in 753 BC. Over "
    "the following centuries, Rome grew from a small town on the Tiber into a republic that "
    "ruled the whole of Italy, and then into an empire that stretched from Britain to Egypt.",
    # issue 23's 45-token answer (the 135M model capitalises the items: few exact copies)
    "repeat list": "Repeat this list exactly, one item per line: apples, pears, plums, "
    "cherries, grapes, lemons, limes, mangoes, peaches, apricots",
}
CHAT_PROMPTS = {
    "chat: weekend": "What are some fun things to do on a rainy weekend?",
    "chat: explain": "Explain why the sky is blue to a ten year old.",
    "chat: story": "Write a short story about a robot who learns to paint.",
}


def encode(model: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return model.tokenizer.encode(model.chat_template.render(messages), add_special=False)


def step_times(model: LoadedModel, device: CpuDevice, runs: int) -> list[tuple[int, float]]:
    """Best-of-``runs`` seconds of one model step over T tokens of one sequence (after 180
    tokens of context), T = 1..16, logits for every token (as verification asks)."""
    engine = Engine(model, device, EngineConfig(ctx=512, max_num_seqs=1))
    rng = np.random.default_rng(0)
    req = Request("steps", rng.integers(0, model.hparams.n_vocab, 200).tolist(), 1)
    assert engine.scheduler.kv.allocate(req, 200)
    tokens, positions, batch = flat_batch(engine.pool, [ScheduledChunk(req, 0, 180)])
    engine.executor.run(tokens, positions, np.array([179]), batch)
    best = {t: float("inf") for t in range(1, 17)}
    for _ in range(runs):
        for t in best:
            tokens, positions, batch = flat_batch(engine.pool, [ScheduledChunk(req, 180, t)])
            engine.executor.run(tokens, positions, np.arange(t), batch)  # binds the shape
            t0 = time.perf_counter()
            for _ in range(10):
                engine.executor.run(tokens, positions, np.arange(t), batch)
            best[t] = min(best[t], (time.perf_counter() - t0) / 10)
    return list(best.items())


def generate(
    engine: Engine,
    prompts: list[list[int]],
    n: int,
    whole: bool = False,
    stop: frozenset[int] = frozenset(),
    repeat_penalty: float = 1.0,
) -> tuple[list[list[int]], float]:
    """Greedy answers of ``n`` tokens (or up to a token of ``stop``) to all prompts at once;
    the decode time (from the step that gave every request its first token to the last), or
    with ``whole`` the time of the whole run (requests queued behind the seats: prefills and
    decodes interleave)."""
    params = SamplingParams(max_tokens=n, temperature=0, repeat_penalty=repeat_penalty)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params, stop_ids=stop)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter() if whole else None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        if start is None and all(out.values()):
            start = time.perf_counter()
    return [out[rid] for rid in ids], time.perf_counter() - start


def clock(executor: object, into: dict[str, float], key: str) -> None:
    """Add the seconds ``executor.run`` takes to ``into[key]``."""
    run = executor.run  # type: ignore[attr-defined]

    def timed(*args: object) -> np.ndarray:
        t0 = time.perf_counter()
        out = run(*args)
        into[key] += time.perf_counter() - t0
        return out

    executor.run = timed  # type: ignore[attr-defined]


def compare(
    model: LoadedModel,
    device: CpuDevice,
    drafter: Drafter | None,
    prompts: list[list[int]],
    n: int,
    runs: int,
    split: dict[str, float] | None = None,
    raw: dict[str, list[float]] | None = None,
    seats: int | None = None,
    stop: frozenset[int] = frozenset(),
    repeat_penalty: float = 1.0,
    **config: object,
) -> tuple[float, float, float, bool]:
    """(plain tokens/s, speculative tokens/s, acceptance, identical): medians over ``runs``
    runs alternating the two engines, which one goes first alternating too (a run after
    another is slowed or sped up by what ran before it on a busy machine). ``split``: filled
    with the seconds the speculative runs spent in all, in the target's model steps and in
    a draft model's passes; ``raw``: with each run's tokens/s (``plain``, ``spec``);
    ``seats``: the most sequences running at once (default: all prompts), the rest queued:
    then the rate is every generated token over the whole run's time; ``stop``: the tokens
    that end an answer; ``repeat_penalty``: the sampler's (``dynalm run``'s default is 1.1)."""
    whole = seats is not None and seats < len(prompts)
    seats = seats or max(8, len(prompts))
    base = {"ctx": 1024, "max_num_seqs": seats, "enable_prefix_caching": False}
    plain = Engine(model, device, EngineConfig(**base))
    spec = Engine(model, device, EngineConfig(**base, **config), drafter=drafter)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    same = True
    generate(plain, prompts, 8)  # warm-up: kernels, step shapes
    generate(spec, prompts, 8)
    spec.spec_stats.__init__()
    split = {} if split is None else split
    split.update(total=0.0, target=0.0, draft=0.0)
    clock(spec.executor, split, "target")
    if isinstance(drafter, ModelDrafter):
        clock(drafter.executor, split, "draft")
    for i in range(runs):
        if i % 2:
            t0 = time.perf_counter()
            got, t_spec = generate(spec, prompts, n, whole, stop, repeat_penalty)
            split["total"] += time.perf_counter() - t0
        want, t_plain = generate(plain, prompts, n, whole, stop, repeat_penalty)
        if not i % 2:
            t0 = time.perf_counter()
            got, t_spec = generate(spec, prompts, n, whole, stop, repeat_penalty)
            split["total"] += time.perf_counter() - t0
        same &= got == want
        decoded = sum(len(t) - (not whole) for t in want)
        rates["plain"].append(decoded / t_plain)
        rates["spec"].append(decoded / t_spec)
    if raw is not None:
        raw.update(rates)
    return (
        statistics.median(rates["plain"]),
        statistics.median(rates["spec"]),
        spec.spec_stats.acceptance_rate,
        same,
    )


def row(name: str, plain: float, spec: float, acceptance: float, same: bool) -> str:
    return (
        f"| {name:<28} | {plain:8.1f} | {spec:8.1f} | {spec / plain:5.2f}x | "
        f"{100 * acceptance:5.1f} % | {'yes' if same else 'NO'} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="run the rows whose name contains this text")
    ap.add_argument(
        "--answers", action="store_true", help="each answer ends at the model's end token"
    )
    ap.add_argument("--repeat-penalty", type=float, default=1.0, help="dynalm run's: 1.1")
    args = ap.parse_args()
    os.environ.setdefault("DYNALM_THREADS", str(args.threads))
    device = CpuDevice("auto", threads=args.threads)
    model = load_model(Path(args.model))
    print(f"model {model.name} · {args.model} · threads {device.threads} · runs {args.runs}\n")

    def wanted(name: str) -> bool:
        return args.only in name

    if wanted("step time"):
        print("| T | ms/step | x T=1 |\n|---|---|---|")
        table = step_times(model, device, args.runs)
        for t, s in table:
            print(f"| {t} | {s * 1e3:.2f} | {s / table[0][1]:.2f} |")

    stop = model.stop_token_ids if args.answers else frozenset()
    what = f"answers (<= {args.tokens})" if args.answers else f"tg{args.tokens}"
    what += f", rp {args.repeat_penalty:g}" if args.repeat_penalty != 1 else ""
    head = (
        f"\n| {'greedy, ' + what:<28} | plain t/s | spec t/s | ratio | "
        "accepted | same tokens |\n|---|---|---|---|---|---|"
    )
    print(head)
    n, runs = args.tokens, args.runs
    mixed = [encode(model, t) for t in [*COPY_PROMPTS.values(), *CHAT_PROMPTS.values()]]
    mixed += mixed[: 8 - len(mixed)]
    ngram = {f"ngram, {name}": [encode(model, text)] for name, text in COPY_PROMPTS.items()}
    ngram |= {f"ngram, {name}": [encode(model, text)] for name, text in CHAT_PROMPTS.items()}
    ngram["ngram, 8 streams"] = mixed
    # a server's steady state: 8 seats, 21 requests queued behind them, so a sequence that
    # finishes sooner makes room (the plan values drafts at the batch's rate)
    ngram["ngram, 8 seats, 21 queued"] = mixed[:7] * 3
    # the machine's noise: the 8 streams on two plain engines, compared the same way
    ngram["8 streams, A/A: plain vs plain"] = mixed
    raws: dict[str, dict[str, list[float]]] = {}
    for name, prompts in ngram.items():
        if wanted(name):
            raws[name] = {}
            seats = 8 if "queued" in name else None
            drafter = None if "A/A" in name else NgramDrafter()
            result = compare(
                model, device, drafter, prompts, n, runs, raw=raws[name], seats=seats, stop=stop,
                repeat_penalty=args.repeat_penalty,
            )  # fmt: skip
            print(row(name, *result))
    config = {"ctx": 1024, "max_num_seqs": 8}
    copy = [encode(model, COPY_PROMPTS["edit code"])]
    chat = [encode(model, CHAT_PROMPTS["chat: explain"])]
    splits: dict[str, dict[str, float]] = {}
    for label, adaptive in (("k=4", False), ("adaptive", True)):
        for what, prompts in (("edit code", copy), ("chat", chat)):
            drafters = {
                "self as draft": lambda: ModelDrafter.for_model(model, model, device, **config),
                "layer-skip": lambda: ModelDrafter.layer_skip(model, device, **config),
            }
            for kind, make in drafters.items():
                if not wanted(f"{kind} {label}, {what}"):
                    continue
                name, split = f"{kind} {label}, {what}", {}
                result = compare(
                    model, device, make(), prompts, n, runs, split, adaptive_draft=adaptive
                )
                print(row(name, *result))
                splits[name] = split
    if raws:  # every run, not only the medians (a shared machine is noisy)
        print("\n| n-gram: each run | plain t/s | spec t/s | pairs' median ratio |")
        print("|---|---|---|---|")
        for name, raw in raws.items():
            plain, spec = (" ".join(f"{r:.1f}" for r in raw[k]) for k in ("plain", "spec"))
            # the two runs of a pair ran back to back: their ratio sees the same load
            pairs = zip(raw["plain"], raw["spec"], strict=True)
            paired = statistics.median([b / a for a, b in pairs])
            print(f"| {name} | {plain} | {spec} | {paired:.2f}x |")
    if splits:  # where a draft model's runs spend their time (the rest: the engine's Python)
        print("\n| draft model: time in | target steps | draft passes | the rest |")
        print("|---|---|---|---|")
        for name, split in splits.items():
            total, target, draft = split["total"], split["target"], split["draft"]
            shares = (f"{100 * t / total:.1f} %" for t in (target, draft, total - target - draft))
            print(f"| {name} | " + " | ".join(shares) + " |")


if __name__ == "__main__":
    main()
