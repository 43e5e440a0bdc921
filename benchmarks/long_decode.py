"""Decode speed at a long context, against another source tree in the same run.

Each test is a request of ``--context`` random prompt tokens then ``--gen`` greedy decode
steps through the engine (``dynalm bench``'s runner: one sequence, no prefix cache); the
decode steps' tokens/s is the figure. ``dynalm bench``'s tg tests decode after an 8-token
prompt, where attention is a sliver of a step; here it reads ``context`` keys per layer.
Every source tree (this checkout's ``src``, and ``--baseline DIR``: another tree's
``src``) runs in worker processes of its own with an empty JIT cache, alternating round by
round so machine noise hits them alike; the table gives each round, the medians' ratio and
the best runs' ratio (on an oversubscribed host the least disturbed runs).
``--kernel``: one layer's attention call alone instead (SmolLM2's 9 heads, 3 kv heads of
64, f16 pages of 16 random keys), a decode token at ``context`` keys, the median of 200
calls in microseconds (lower is better; the ratio is then baseline / this).

    python benchmarks/long_decode.py --model PATH.gguf --baseline OTHER/src \\
        [--context 2000,4000] [--gen 32] [--threads 2] [--rounds 3] [--kernel]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "src"


def worker(model: str, context: int, gen: int, threads: int) -> None:
    """One test in this process: print its decode tokens/s as JSON."""
    import numpy as np

    from dynalm.bench import DynaLMRunner, bench_config
    from dynalm.models.loader import load_model
    from dynalm.runtime.engine.build import EngineSpec, build_engine

    loaded = load_model(Path(model))
    config = bench_config(context + gen + 16)
    runner = DynaLMRunner(build_engine(EngineSpec(loaded, config, "cpu", "auto", threads)))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, loaded.hparams.n_vocab, context).tolist()
    ids = list(range(gen))  # only their count matters: the steps decode greedily
    runner.decode(prompt[:64], ids[:4])  # warm-up: the kernels compiled, pools started
    seconds = runner.decode(prompt, ids)
    print(json.dumps({"tok_s": gen / seconds}))


def kernel_worker(context: int, threads: int) -> None:
    """One decode token's attention at ``context`` keys: print the median call in us."""
    import time

    import numpy as np

    from dynalm.core.attention import PagedAttention, StepLayout
    from dynalm.core.kv_storage import AttentionBatch
    from dynalm.runtime.engine.kv_cache import PagePool

    heads, kv_heads, head_dim, page = 9, 3, 64, 16
    n_pages = -(-context // page)
    pool = PagePool(1, kv_heads, head_dim, n_pages, page, "f16", n_seqs=1)
    pages = list(range(n_pages))
    rng = np.random.default_rng(0)
    earlier = pool.slots(pages, 0, context - 1)
    shape = (len(earlier), kv_heads, head_dim)
    pool.storage.write(0, earlier, *(rng.standard_normal(shape, np.float32) for _ in "kv"))
    slots = pool.slots(pages, context - 1, context)
    batch = AttentionBatch(
        pool.storage, np.array([0, 1]), np.array([context]), [np.array(pages)], slots
    )
    step = StepLayout()
    step.set(batch, np.array([context - 1], np.int64))
    q, out = (rng.standard_normal((1, heads * head_dim), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, kv_heads * head_dim), np.float32) for _ in range(2))
    attention = PagedAttention(step, 0, heads, kv_heads, head_dim, 0.125, 0, threads, out, q, k, v)
    times = []
    for _ in range(220):
        start = time.perf_counter()
        attention()
        times.append(time.perf_counter() - start)
    print(json.dumps({"us": 1e6 * statistics.median(times[20:])}))


def run(src: Path, args: argparse.Namespace, context: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(src), "DYNALM_CACHE": cache}
        cmd = [sys.executable, __file__, "--worker", "--model", args.model]
        cmd += ["--context", str(context), "--gen", str(args.gen), "--threads", str(args.threads)]
        cmd += ["--kernel"] if args.kernel else []
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(next(iter(json.loads(out.strip().splitlines()[-1]).values())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--baseline", type=Path, help="another tree's src (required)")
    p.add_argument("--context", default="2000,4000")
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernel", action="store_true", help="one attention call, in us")
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker and args.kernel:
        kernel_worker(int(args.context), args.threads)
        return
    if args.worker:
        worker(args.model, int(args.context), args.gen, args.threads)
        return
    if args.baseline is None:
        p.error("--baseline DIR: the source tree to compare with")
    trees = {"this": HERE, "baseline": args.baseline.resolve()}
    for context in (int(c) for c in args.context.split(",")):
        rates: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, src in trees.items():
                rates[name].append(run(src, args, context))
        cells = {name: " ".join(f"{r:.1f}" for r in rs) for name, rs in rates.items()}
        ratio = statistics.median(rates["this"]) / statistics.median(rates["baseline"])
        best = max(rates["this"]) / max(rates["baseline"])  # the least disturbed runs
        what = f"tg{args.gen} tok/s"
        if args.kernel:  # times: the speed-up is the other way round, and the best the least
            ratio, what = 1 / ratio, "attention call us"
            best = min(rates["baseline"]) / min(rates["this"])
        print(
            f"context {context}, {args.threads} threads, {what}: this {cells['this']}"
            f" | baseline {cells['baseline']} | speed-up: median {ratio:.2f}x, best {best:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
