"""What the repack cache saves a mixture's expert made from a Hugging Face directory: one
gpt-oss expert matrix (MXFP4 blocks and scales as the released checkpoints store them,
random bytes, ``--rows`` x ``--cols``: gpt-oss-20b's 2880 x 2880 by default) made in
ggml's block order (``hf_gpt_oss.mxfp4_rows``) and repacked into the auto kernels'
layout on a first start, then read from the cache on later ones (a fresh cache
directory; the key's shape as ``HFDirectory.source`` gives it). Best of ``--repeat``.

    python benchmarks/expert_cache.py [--rows 2880] [--cols 2880] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2880)
    parser.add_argument("--cols", type=int, default=2880, help="a multiple of 32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    os.environ["DYNALM_REPACK_CACHE"] = tempfile.mkdtemp(prefix="dynalm-repack-")
    from gguf import GGMLQuantizationType

    from dynalm.core.matmul import QuantMatmul
    from dynalm.models import hf_gpt_oss

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (args.rows, args.cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, (args.rows, args.cols // 32), dtype=np.uint8)
    made, cached = [], []
    for i in range(args.repeat):  # a new key per round: its first prepare makes and writes
        key = (f"/model#blk.0.ffn_gate_exps.weight:{i}+{args.rows}", "identity;made by bench")
        for times in (made, cached):
            t0 = time.perf_counter()
            mm = QuantMatmul(
                lambda: hf_gpt_oss.mxfp4_rows(blocks, scales),
                GGMLQuantizationType.MXFP4,
                args.cols,
                mode="auto",
                source=key,
                n_rows=args.rows,
            )
            times.append(time.perf_counter() - t0)
            assert mm.repacked == (times is made)
    mib = args.rows * args.cols * 17 / 32 / 2**20
    print(
        f"MXFP4 expert {args.rows} x {args.cols} ({mib:.1f} MiB): made and repacked "
        f"{min(made) * 1e3:.1f} ms, read from the cache {min(cached) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
