"""What an empty JIT cache adds to a model's first answer, and what the kernels it
compiles cost.

Each run is a fresh process: load the model, bind it, answer one short greedy request
(prefill + 4 tokens). A *cold* run starts from an empty ``$DYNALM_CACHE`` (every kernel
compiled), the *warm* run that follows reuses it (object code loaded). The repack cache
is off in both, so only compiling differs. Reported: the median of the cold - warm
differences over ``--runs`` pairs, and per cold run the modules compiled, their total
and median compile time.

    python benchmarks/cold_start.py --model PATH [--runs 3] [--mode auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from dynalm.kernel import jit
compiles = []
compile = jit._Engine.compile
def timed(self, ir, names):
    t0 = time.perf_counter()
    out = compile(self, ir, names)
    if out[1]:  # compiled here, not loaded from the cache
        compiles.append(time.perf_counter() - t0)
    return out
jit._Engine.compile = timed
from dynalm.core.device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.generator import Generator
from dynalm.runtime.sampling import SamplingParams
t0 = time.perf_counter()
gen = Generator(load_model(sys.argv[1]), CpuDevice(sys.argv[2]), ctx=512)
list(gen.generate(list(range(1, 40)), SamplingParams(max_tokens=4, temperature=0)))
print(json.dumps({"seconds": time.perf_counter() - t0, "compiles": compiles}))
"""


def run(model: str, mode: str, cache: str) -> dict:
    env = {**os.environ, "DYNALM_CACHE": cache, "DYNALM_REPACK_CACHE": "off"}
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
    args = ap.parse_args()
    added = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="dynalm-cold-") as cache:
            cold, warm = run(args.model, args.mode, cache), run(args.model, args.mode, cache)
        added.append(cold["seconds"] - warm["seconds"])
        times = cold["compiles"]
        print(
            f"run {i + 1}: cold {cold['seconds']:.2f} s, warm {warm['seconds']:.2f} s; "
            f"{len(times)} modules compiled, {sum(times):.2f} s in all, "
            f"median {1e3 * statistics.median(times):.0f} ms"
        )
    print(f"an empty JIT cache adds {statistics.median(added):.2f} s (median of {args.runs})")


if __name__ == "__main__":
    main()
