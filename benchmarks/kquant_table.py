"""SmolLM2 as K-quant files, each benched against llama.cpp: the issue's K-quant table.

Writes the files with llama.cpp's own quantiser (``llama_cpp.llama_model_quantize``, the
``dynalm[bench]`` extra) into ``.cache/kquant/`` (git-ignored; an existing file is reused),
prints each file's tensor types, then runs ``dynalm bench FILE --vs llama.cpp`` on it.

    python benchmarks/kquant_table.py [--source GGUF] [--formats q4_k_m,q6_k,q8_0]
        [-- BENCH ARGS]      # default: -p 512 -n 128 -r 3 -t 2

The source defaults to ``smollm2:135m`` from the store (a Q4_1 file), so the files are
requantised: fine for speed, not for quality. SmolLM2's 576-wide rows are not a multiple
of the 256-weight K-quant block, so llama.cpp falls back to legacy types for most tensors
of a "K-quant" file; the type census says what was really measured.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

FTYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
FTYPES |= {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
K_QUANT_TABLE = "q4_k_m,q6_k,q8_0"
BENCH_ARGS = ["-p", "512", "-n", "128", "-r", "3", "-t", "2"]


def quantize(source: Path, out: Path, fmt: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[fmt])
    params.allow_requantize = True  # the store's SmolLM2 is already Q4_1
    params.nthread = os.cpu_count() or 1
    partial, log = out.with_suffix(".partial"), out.with_suffix(".log")
    # The quantiser prints a line per tensor from C: keep it in a log, not on the terminal.
    saved = os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            failed = llama_cpp.llama_model_quantize(
                str(source).encode(), str(partial).encode(), params
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if failed:
        raise SystemExit(f"llama_model_quantize failed for {fmt}: see {log}")
    partial.rename(out)


def census(path: Path) -> str:
    from dynalm.core.quant import ggml_type_name
    from dynalm.models.gguf_file import GGUFFile

    with GGUFFile(path) as gguf:
        types = Counter(ggml_type_name(t.ggml_type) for t in gguf.tensors.values())
    return ", ".join(f"{n} {name}" for name, n in types.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, help="GGUF to quantise (default: smollm2:135m)")
    parser.add_argument("--formats", default=K_QUANT_TABLE, help=", ".join(FTYPES))
    parser.add_argument("--out", type=Path, default=Path(".cache/kquant"))
    parser.add_argument("bench_args", nargs="*", help="after --: arguments for dynalm bench")
    args = parser.parse_args()
    if args.source is None:
        from dynalm.store.catalog import ModelStore

        args.source = ModelStore().resolve("smollm2:135m")
    formats = [f.strip() for f in args.formats.split(",")]
    if unknown := set(formats) - FTYPES.keys():
        parser.error(f"unknown formats {sorted(unknown)}; choose from {', '.join(FTYPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        path = args.out / f"smollm2-{fmt}.gguf"
        if not path.exists():
            quantize(args.source, path, fmt)
        # The load average says how noisy the machine was; compare the ratio column.
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n## {fmt}: {census(path)}", flush=True)
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} · load average {load}\n", flush=True)
        cmd = [sys.executable, "-m", "dynalm.cli", "bench", str(path), "--vs", "llama.cpp"]
        subprocess.run([*cmd, *(args.bench_args or BENCH_ARGS)], check=True)


if __name__ == "__main__":
    main()
