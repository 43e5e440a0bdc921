"""What an empty JIT cache adds to a model's first answer, and what the kernels it
compiles cost.

Each run is a fresh process: load the model, bind it, answer one short greedy request
(prefill + 4 tokens). A *cold* run starts from an empty ``$DYNALM_CACHE`` (every kernel
compiled), the *warm* run that follows reuses it (object code loaded). The repack cache
is off in both, so only compiling differs. Reported: the median of the cold - warm
differences over ``--runs`` pairs, and per cold run the modules compiled, their total
and median compile time (each module's own: modules compiled concurrently overlap, so
the total may exceed what they add). ``--baseline REV`` also runs git revision REV, its
pairs alternating with this tree's so machine noise hits both alike.

    python benchmarks/cold_start.py --model PATH [--runs 3] [--mode auto] [--baseline REV]
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

from kernel_bench import checkout  # the benchmarks directory is sys.path[0]

CHILD = r"""
import json, sys, threading, time
from dynalm.kernel import jit
compiles = []
if hasattr(jit, "_emit_object"):  # one module's compile, on whichever thread runs it
    emit = jit._emit_object
    def timed(ir, tm):
        obj, seconds = emit(ir, tm)
        compiles.append(seconds)
        return obj, seconds
    jit._emit_object = timed
else:  # revisions that compiled one module at a time, in _Engine.compile
    compile = jit._Engine.compile
    def timed(self, ir, names):
        t0 = time.perf_counter()
        out = compile(self, ir, names)
        if out[1]:  # compiled here, not loaded from the cache
            compiles.append(time.perf_counter() - t0)
        return out
    jit._Engine.compile = timed
from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.generator import Generator, generator_config
from dynalm.runtime.engine.sampling import SamplingParams
t0 = time.perf_counter()
gen = Generator(Engine(load_model(sys.argv[1]), CpuDevice(sys.argv[2]), generator_config(512)))
list(gen.generate(list(range(1, 40)), SamplingParams(max_tokens=4, temperature=0)))
print(json.dumps({"seconds": time.perf_counter() - t0, "compiles": compiles}))
"""


def run(model: str, mode: str, cache: str, src: str | None) -> dict:
    env = {**os.environ, "DYNALM_CACHE": cache, "DYNALM_REPACK_CACHE": "off"}
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", default="auto", choices=["auto", "exact"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", metavar="REV", help="also run git revision REV")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dynalm-cold-src-") as tmp:
        variants = {"this tree": None}  # None: dynalm as imported here (PYTHONPATH)
        if args.baseline:
            variants[args.baseline] = str(checkout(args.baseline, Path(tmp)))
        added: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.runs):
            for name, src in variants.items():
                with tempfile.TemporaryDirectory(prefix="dynalm-cold-") as cache:
                    cold = run(args.model, args.mode, cache, src)
                    warm = run(args.model, args.mode, cache, src)
                added[name].append(cold["seconds"] - warm["seconds"])
                times = cold["compiles"]
                print(
                    f"{name}, run {i + 1}: cold {cold['seconds']:.2f} s, "
                    f"warm {warm['seconds']:.2f} s; {len(times)} modules compiled, "
                    f"{sum(times):.2f} s in all, median {1e3 * statistics.median(times):.0f} ms",
                    flush=True,
                )
    for name, values in added.items():
        print(
            f"{name}: an empty JIT cache adds {statistics.median(values):.2f} s "
            f"(median of {args.runs})"
        )


if __name__ == "__main__":
    main()
