"""How closely a KV cache dtype follows f16 KV: greedy text and logits on fixed prompts.

For each prompt, f16 KV generates a greedy continuation; the other dtype then
- generates its own (free-running): the share of positions where it picked f16's token;
- scores f16's continuation (teacher-forced): its worst logit error per token against f16,
  the error in the gap between f16's top two tokens, and how often its top-1 differs.

    python benchmarks/kv_fidelity.py [--model smollm2:135m] [--kv-dtype q8_0]
        [--mode exact] [--tokens 64] [--prompts 40]

Exact mode by default: in auto, int8 activations turn any tiny difference into another
continuation (even f32 vs f16 KV). Free-running agreement is set by near-ties: once a
continuation parts, the rest rarely lines up again, so read it with the logit errors.
"""

from __future__ import annotations

import argparse

import numpy as np

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.generator import Generator, generator_config
from dynalm.store.catalog import ModelStore

PROMPTS = [
    "The Industrial Revolution changed how people",
    "Volcanoes form when",
    "class Stack:\n    def __init__(self):\n",
    "The four seasons of the year are",
    "Long ago, a fisherman found a bottle that",
    "The tallest mountain in Africa is",
    "Ice melts at a temperature of",
    "The most useful kitchen tool is",
    "The best way to learn a new language is",
    "In 1969, astronauts",
    "A healthy breakfast includes",
    "The main causes of climate change are",
    "To make a cup of tea, first",
    "The largest planet in our solar system",
    "import numpy as np\n\ndef normalize(x):\n",
    "Dear hiring manager, I am writing to",
    "The French Revolution started because",
    "Machine learning is a field of",
    "The recipe calls for two cups of",
    "In the beginning of the twentieth century,",
    "SELECT name, age FROM users WHERE",
    "The theory of relativity states that",
    "My grandmother always told me",
    "The stock market crashed in",
    "Cats are popular pets because",
    "The human heart has four chambers:",
    "for i in range(10):\n",
    "The Amazon rainforest is home to",
    "A good night's sleep helps",
    "The Great Wall of China was built",
    "Electric cars differ from gasoline cars in",
    "Shakespeare wrote",
    "The quick brown fox",
    "To solve a quadratic equation,",
    "The ocean is salty because",
    "Bees are important for",
    "The internet was invented",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 12 times 7? And divided by 4?",
]


def greedy(model, device, kv: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    ctx = n + max(map(len, prompts)) + 1
    config = EngineConfig(ctx=ctx, max_num_seqs=16, kv_cache_dtype=kv, enable_prefix_caching=False)
    engine = Engine(model, device, config)
    params = SamplingParams(max_tokens=n, temperature=0, repeat_penalty=1.0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, stop_ids=frozenset())
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id)] += o.token_ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2:135m", help="a store name or a GGUF path")
    ap.add_argument("--kv-dtype", default="q8_0", help="compared with f16: f32 | q8_0")
    ap.add_argument("--mode", default="exact", help="auto | exact | safe")
    ap.add_argument("--tokens", type=int, default=64, help="continuation length")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the 40")
    args = ap.parse_args()
    model = load_model(ModelStore().resolve(args.model))
    device = CpuDevice(args.mode)
    prompts = [model.tokenizer.encode(t, add_special=True) for t in PROMPTS[: args.prompts]]
    n = args.tokens
    ref = greedy(model, device, "f16", prompts, n)
    ours = greedy(model, device, args.kv_dtype, prompts, n)
    agree = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(ref, ours, strict=True)]
    worst, gap, flips = [], [], 0
    for prompt, cont in zip(prompts, ref, strict=True):
        ids = prompt + cont
        logits = {}
        for kv in ("f16", args.kv_dtype):
            scorer = Generator(Engine(model, device, generator_config(len(ids) + 1, kv)))
            logits[kv] = scorer.forward(ids, all_logits=True)[len(prompt) - 1 : len(ids) - 1]
        a, b = logits["f16"], logits[args.kv_dtype]
        worst.append(np.abs(b - a).max(-1))
        flips += int((a.argmax(-1) != b.argmax(-1)).sum())
        top2 = np.argsort(a, -1)[:, -2:]
        gap.append(np.abs(np.diff(np.take_along_axis(b - a, top2, -1), axis=-1))[:, 0])
    worst_all, gap_all = np.concatenate(worst), np.concatenate(gap)
    total = n * len(prompts)
    print(f"{args.kv_dtype} vs f16 KV, {len(prompts)} prompts x {n} tokens, mode {args.mode}")
    print(f"free-running agreement per prompt: {agree}")
    print(
        f"free-running agreement: {sum(agree)}/{total} = {sum(agree) / total:.1%} "
        f"({sum(a < n for a in agree)} prompts part from f16)"
    )
    print(
        f"teacher-forced: worst logit error per token mean {worst_all.mean():.4f}, "
        f"top-2 gap error mean {gap_all.mean():.4f} (p95 {np.percentile(gap_all, 95):.4f}), "
        f"top-1 differs at {flips}/{total}"
    )


if __name__ == "__main__":
    main()
