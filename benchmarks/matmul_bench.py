"""Quantised matmul throughput on SmolLM2-135M shapes, side by side, as ratios.

Random weights with the real layouts (Q4_1 layers and a Q8_0 tied output, like the
published file; ``--format`` swaps the layer format). Reported, with runs of the
variants alternated so machine noise hits them alike:

* per shape, GEMV (T=1) on 1 and N threads: microseconds and GB/s of weight bytes;
* one decode step's matmuls (30 layers x 7 + output), 1 vs N threads, in ms;
* prefill (T=512) of all layer matmuls, JIT vs numpy dequantise + BLAS, in seconds.

``--baseline REV`` also runs the decode step with ``core/matmul.py`` as of git revision
REV (loaded beside the working tree's, its kernels renamed), alternated with the current
kernels: before vs after in one process.

``--mode auto`` runs int8 kernels only for the formats ``CpuDevice`` validated (the Q8_0
output stays exact), as the engine does.

    python benchmarks/matmul_bench.py [--threads N] [--mode auto|exact] [--format q4_k]
        [--baseline HEAD]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from dynalm.core import matmul
from dynalm.core.matmul import AUTO_VALIDATED, QuantMatmul
from dynalm.core.quant import dequantize, quant_format, random_blocks

# (name, N, K, count per decode step) for SmolLM2-135M: 30 layers, tied 49152-token output.
LAYER_SHAPES = [
    ("attn_q/o", 576, 576, 60),
    ("attn_k/v", 192, 576, 60),
    ("ffn_gate/up", 1536, 576, 60),
    ("ffn_down", 576, 1536, 30),
]
OUTPUT = ("output", 49152, 576, 1)
Q8_0, Q5_0 = int(GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q5_0)


def random_weights(ggml_type: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    fmt = quant_format(ggml_type)
    return random_blocks(ggml_type, n * k // fmt.block_size, rng).reshape(n, -1)


def baseline_matmul(rev: str) -> type[QuantMatmul]:
    """``QuantMatmul`` of ``core/matmul.py`` at git revision ``rev``, as a separate module
    whose kernel names do not clash with the current ones in the process-wide JIT."""
    root = Path(matmul.__file__).resolve().parents[3]
    src = subprocess.run(
        ["git", "show", f"{rev}:src/dynalm/core/matmul.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.replace("dynalm_mm_", "dynalm_mm_baseline_")
    module = types.ModuleType("dynalm.core.matmul_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:matmul.py", "exec"), module.__dict__)
    return module.QuantMatmul


def alternate(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Best wall time of each function, running them in turn ``repeat`` times."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="auto", choices=["auto", "exact"])
    ap.add_argument("--format", default="q4_1")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--baseline", metavar="REV", help="also time the decode step at git REV")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    layer_type = int(GGMLQuantizationType[args.format.upper()])
    nt = args.threads

    def layer_format(name: str, k: int) -> int:
        """``--format`` for layers; rows that are not whole K-quant super-blocks fall back
        to Q5_0 as llama.cpp's quantiser does (SmolLM2's K=576 does)."""
        if name == "output":
            return Q8_0
        return Q5_0 if k % quant_format(layer_type).block_size else layer_type

    def mode(ggml_type: int) -> str:
        """The kernel mode CpuDevice picks: auto only for formats it validated."""
        return args.mode if ggml_type in AUTO_VALIDATED else "exact"

    print(f"{args.format} layers + q8_0 output, {args.mode}, 1 vs {nt} threads, best of runs")
    print(f"{'shape':<12} {'N x K':>12} | {'1t us':>7} {'GB/s':>5} | {f'{nt}t us':>7} {'GB/s':>5}")
    prefill = []
    for name, n, k, count in [*LAYER_SHAPES, OUTPUT]:
        ggml_type = layer_format(name, k)
        raw = random_weights(ggml_type, n, k, rng)
        mms = [QuantMatmul(raw, ggml_type, k, mode=mode(ggml_type), threads=t) for t in (1, nt)]
        x1, y1 = rng.standard_normal((1, k)).astype(np.float32), np.empty((1, n), np.float32)
        t1, tn = alternate([lambda m=m, x=x1, y=y1: m(x, y) for m in mms], args.repeat * 5)
        gb = raw.nbytes / 1e9
        print(f"{name:<12} {f'{n}x{k}':>12} | {t1 * 1e6:7.1f} {gb / t1:5.1f} | ", end="")
        print(f"{tn * 1e6:7.1f} {gb / tn:5.1f}")
        if name != "output":
            xp = rng.standard_normal((args.prefill, k)).astype(np.float32)
            yp = np.empty((args.prefill, n), np.float32)
            prefill.append((mms[1], raw, ggml_type, k, xp, yp, count))

    # A decode step reads distinct weights (96 MB for Q4_1), as a real one streams them.
    # Each variant is (label, QuantMatmul class, threads); all are alternated.
    variants = [("1 thread", QuantMatmul, 1), (f"{nt} threads", QuantMatmul, nt)]
    if args.baseline:
        base = baseline_matmul(args.baseline)
        variants += [(f"{args.baseline} 1 thread", base, 1), (f"{args.baseline} {nt}", base, nt)]
    step, total = [], 0
    for name, n, k, count in [*LAYER_SHAPES, OUTPUT]:
        ggml_type = layer_format(name, k)
        x1, y1 = rng.standard_normal((1, k)).astype(np.float32), np.empty((1, n), np.float32)
        for _ in range(count):
            raw = random_weights(ggml_type, n, k, rng)
            total += raw.nbytes
            m = mode(ggml_type)
            mms = [cls(raw, ggml_type, k, mode=m, threads=t) for _, cls, t in variants]
            step.append((mms, x1, y1))

    def decode(which: int) -> None:
        for mms, x, y in step:
            mms[which](x, y)

    times = alternate([lambda i=i: decode(i) for i in range(len(variants))], args.repeat)
    print(f"decode step, all matmuls ({total / 1e6:.0f} MB), ms (GB/s), x vs the first:")
    for (label, _, _), t in zip(variants, times, strict=True):
        print(f"  {label:<16} {t * 1e3:6.2f} ({total / t / 1e9:4.1f})  x{times[0] / t:.2f}")

    def pp_jit() -> None:
        for mm, _, _, _, xp, yp, count in prefill:
            for _ in range(count):
                mm(xp, yp)

    def pp_numpy() -> None:
        for _, raw, ggml_type, k, xp, yp, count in prefill:
            for _ in range(count):
                np.matmul(xp, dequantize(raw, ggml_type, k).T, out=yp)

    pj, pn = alternate([pp_jit, pp_numpy], max(1, args.repeat // 10))
    print(
        f"prefill T={args.prefill}, all layer matmuls: {pj:.3f} s ({args.prefill / pj:.0f} "
        f"tok/s) vs numpy dequantise + BLAS {pn:.3f} s; ratio {pn / pj:.2f}"
    )


if __name__ == "__main__":
    main()
