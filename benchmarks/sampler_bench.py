"""Sampling cost per sequence-token: the batched sampler of a step, by vocabulary and settings.

For a step of S sequences, the time of `sample_rows` (with each row's penalties applied
first, as the engine does) divided by S, on random logits (normal, std 3: flatter in the
tail than a real model's, so top-p's nucleus is larger: the pessimistic case), or with
``--model`` on real logits of that model over a text. Settings: greedy; the OpenAI
defaults (temperature 1, top_p 1, top_k 0: the plain softmax); llama.cpp's defaults
(top-k 40, top-p 0.95, min-p 0.05, T 0.8, repeat penalty 1.1); top-p 0.9 alone; min-p
0.05 alone. Vocabularies: SmolLM2's 49,152 and Gemma 3's 262,144.

``--baseline REV`` also times the sampler of ``src/dynalm/runtime/engine/sampling.py`` at git
revision REV (its per-sequence ``Sampler.sample``), alternated with the current one.

    python benchmarks/sampler_bench.py [--batch 1,8] [--baseline REV] [--model GGUF]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from dynalm.runtime.engine.sampling import Sampler, SamplingParams, sample_rows

SETTINGS = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.0),
    "openai defaults": dict(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top_p 0.9": dict(temperature=1.0, top_k=0, top_p=0.9, repeat_penalty=1.0),
    "min_p 0.05": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, repeat_penalty=1.0),
}
VOCABS = (49_152, 262_144)
HISTORY = 200  # tokens of context the penalties look at (the last 64 of them)


def timed(fn, repeats: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def current(params: SamplingParams, logits: np.ndarray, history: list[int]):
    samplers = [Sampler(params) for _ in logits]
    rows = logits.copy()  # the engine penalises the step's own buffer in place

    def step() -> None:
        for sampler, row in zip(samplers, rows, strict=True):
            sampler.penalize(row, history)
        sample_rows(samplers, rows)

    return step


def baseline(module: types.ModuleType, params: SamplingParams, logits: np.ndarray, history):
    samplers = [module.Sampler(module.SamplingParams(**vars(params))) for _ in logits]

    def step() -> None:
        for sampler, row in zip(samplers, logits, strict=True):
            sampler.sample(row, history)

    return step


TEXT = (
    "The history of the Roman Empire begins with the founding of the city of Rome. Over the "
    "centuries the Romans conquered many peoples, built roads and aqueducts, and wrote laws"
)


def real_logits(path: str) -> np.ndarray:
    """The model's logits at every position of ``TEXT``, [positions, vocab]."""
    from dynalm.core.cpu_device import CpuDevice
    from dynalm.models.loader import load_model
    from dynalm.runtime.engine.engine import Engine
    from dynalm.runtime.generator import Generator, generator_config

    model = load_model(path)
    ids = model.tokenizer.encode(TEXT, add_special=True)
    generator = Generator(Engine(model, CpuDevice("auto"), generator_config(256)))
    return generator.forward(ids, all_logits=True)


def load_baseline(rev: str) -> types.ModuleType:
    root = Path(__file__).resolve().parents[1]
    for path in ("src/dynalm/runtime/engine/sampling.py", "src/dynalm/runtime/sampling.py"):
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True
        )  # (before the engine/ package the sampler was runtime/sampling.py)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    module = types.ModuleType(f"sampling_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8", help="sequences per step, comma-separated")
    ap.add_argument("--baseline", help="git revision whose sampler to time alongside")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--model", help="a GGUF whose real logits to sample instead of random ones")
    args = ap.parse_args()
    old = load_baseline(args.baseline) if args.baseline else None
    rng = np.random.default_rng(0)
    real = real_logits(args.model) if args.model else None
    head = f"| {'vocab':>7} | {'S':>2} | {'setting':<18} | ms per sequence-token |"
    print(head + (f" {args.baseline} ms | ratio |" if old else ""))
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|")
    for vocab in VOCABS if real is None else (real.shape[1],):
        for batch in (int(b) for b in args.batch.split(",")):
            if real is None:
                logits = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
            else:  # each sequence of the step at another position of the text
                logits = real[rng.integers(0, len(real), batch)]
            history = rng.integers(0, vocab, HISTORY).tolist()
            for name, setting in SETTINGS.items():
                params = SamplingParams(**setting)
                ours = timed(current(params, logits, history), args.repeats) / batch
                line = f"| {vocab:>7} | {batch:>2} | {name:<18} | {ours * 1e3:21.3f} |"
                if old:
                    theirs = timed(baseline(old, params, logits, history), 5) / batch
                    line += f" {theirs * 1e3:{len(args.baseline) + 3}.3f} | {theirs / ours:5.1f} |"
                print(line)


if __name__ == "__main__":
    main()
