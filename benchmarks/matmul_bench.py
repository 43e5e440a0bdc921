"""Quantised matmul throughput on SmolLM2-135M shapes, side by side with numpy.

Q4_1 weights (random, with the real layout): GEMV (T=1) as GB/s of weight bytes read,
prefill (T=512) as tokens/s, and one decode step's matmuls (30 layers + output) in ms.
The baseline is numpy dequantise + BLAS per call; numpy on pre-dequantised fp32 weights
(``--mode safe``) is shown as well. Machines are shared: compare the ratios, not absolutes.

    python benchmarks/matmul_bench.py [--threads N] [--mode auto|exact] [--repeat R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from dynalm.core.matmul import QuantMatmul
from dynalm.core.quant import dequantize

Q4_1 = int(GGMLQuantizationType.Q4_1)
# (name, N, K, count per decode step) for SmolLM2-135M: 30 layers, tied 49152-token output.
SHAPES = [
    ("attn_q/o", 576, 576, 60),
    ("attn_k/v", 192, 576, 60),
    ("ffn_gate/up", 1536, 576, 60),
    ("ffn_down", 576, 1536, 30),
    ("output", 49152, 576, 1),
]


def random_q4_1(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_1 rows: 20-byte blocks of (f16 d, f16 m, 16 nibble bytes)."""
    blocks = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
    blocks[:, :, 0:2] = np.full((n, k // 32), 0.01, np.float16).view(np.uint8).reshape(n, -1, 2)
    blocks[:, :, 2:4] = np.full((n, k // 32), -0.08, np.float16).view(np.uint8).reshape(n, -1, 2)
    return blocks.reshape(n, -1)


def best(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of ``repeat`` runs (best-of is the least noisy on a shared machine)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mode", default="auto", choices=["auto", "exact"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=512)
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    print(f"Q4_1 {args.mode}, threads={args.threads or 'default'}; best of {args.repeat}")
    head = f"{'shape':<12} {'N x K':>12} | {'T=1 us':>8} {'GB/s':>6} {'numpy us':>9} {'ratio':>6}"
    head += f" | {'T=' + str(args.prefill) + ' tok/s':>13} {'numpy tok/s':>12} {'ratio':>6}"
    print(head)
    step_ms = step_np_ms = 0.0
    for name, n, k, count in SHAPES:
        raw = random_q4_1(n, k, rng)
        mm = QuantMatmul(raw, Q4_1, k, mode=args.mode, threads=args.threads)
        w32 = dequantize(raw, Q4_1, k)
        x1 = rng.standard_normal((1, k)).astype(np.float32)
        xp = rng.standard_normal((args.prefill, k)).astype(np.float32)
        y1 = np.empty((1, n), np.float32)
        yp = np.empty((args.prefill, n), np.float32)

        t1 = best(lambda mm=mm, x1=x1, y1=y1: mm(x1, y1), args.repeat)
        np1 = best(lambda raw=raw, k=k, x1=x1: x1 @ dequantize(raw, Q4_1, k).T, 3)
        tp = best(lambda mm=mm, xp=xp, yp=yp: mm(xp, yp), max(2, args.repeat // 5))
        npp = best(lambda raw=raw, k=k, xp=xp: xp @ dequantize(raw, Q4_1, k).T, 3)
        safe = best(lambda w32=w32, x1=x1: x1 @ w32.T, args.repeat)
        step_ms += count * t1 * 1e3
        step_np_ms += count * safe * 1e3
        print(
            f"{name:<12} {f'{n}x{k}':>12} | {t1 * 1e6:8.1f} {raw.nbytes / t1 / 1e9:6.1f} "
            f"{np1 * 1e6:9.0f} {np1 / t1:6.1f} | {args.prefill / tp:13.0f} "
            f"{args.prefill / npp:12.0f} {npp / tp:6.1f}"
        )
    print(
        f"decode step, all matmuls: {step_ms:.2f} ms "
        f"(numpy on pre-dequantised fp32 weights: {step_np_ms:.2f} ms, "
        f"ratio {step_np_ms / step_ms:.1f})"
    )


if __name__ == "__main__":
    main()
