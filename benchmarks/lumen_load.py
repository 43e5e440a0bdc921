"""What a family's ``.lum`` file adds to model load, in a fresh process each time: importing
Lumen (beyond what the loader imports anyway), reading the family file's tree (from the
tree cache; with ``--cold`` an empty cache each run, so lark is imported and parses) and
checking it, and elaborating it against the model's metadata and tensor types (the DynaIR
graph). ``--repeat`` runs; the median CPU time of the process (steadier than wall time on a
shared machine) and wall time.

    python benchmarks/lumen_load.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--cold]
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
from dynalm.models.gguf_file import GGUFFile
# what model load imports anyway (the loader's other modules), so that "import" is Lumen's
import dynalm.ir.builder, dynalm.ir.passes, dynalm.models.chat_template, dynalm.models.hparams
import dynalm.models.tokenizer
gguf = GGUFFile(sys.argv[1])
clocks = (time.process_time, time.perf_counter)
shapes = {n: t.shape for n, t in gguf.tensors.items()}
hp = dynalm.models.hparams.read_hparams(gguf.metadata, shapes)
t0 = [c() for c in clocks]
from dynalm.models.arch import build_graph, family_file, family_program, tensor_types
t1 = [c() for c in clocks]
program = family_program(family_file(gguf.architecture))
t2 = [c() for c in clocks]
graph = build_graph(hp, gguf.metadata, tensor_types(gguf))
t3 = [c() for c in clocks]
steps = {"import": (t0, t1), "parse": (t1, t2), "elaborate": (t2, t3)}
print(json.dumps({
    "steps": {k: [b[i] - a[i] for i in range(2)] for k, (a, b) in steps.items()},
    "nodes": len(graph.nodes), "file": str(family_file(gguf.architecture)),
    "lark": "lark" in sys.modules,
}))
"""


def run(model: str, cold: bool) -> dict:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["DYNALM_CACHE"] = cache
        out = subprocess.check_output([sys.executable, "-c", CHILD, model], text=True, env=env)
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="an empty tree cache each run")
    args = parser.parse_args()
    if not args.cold:
        run(args.model, cold=False)  # fill the cache
    runs = [run(args.model, args.cold) for _ in range(args.repeat)]
    lark = "lark imported" if runs[0]["lark"] else "lark not imported"
    print(f"{runs[0]['file']}: a graph of {runs[0]['nodes']} nodes; {lark}")
    print(f"  {'':<10} {'cpu':>8} {'wall':>8}   (median of {args.repeat})")
    total = [0.0, 0.0]
    for step in runs[0]["steps"]:
        ms = [1000 * statistics.median(r["steps"][step][i] for r in runs) for i in range(2)]
        total = [t + m for t, m in zip(total, ms, strict=True)]
        print(f"  {step:<10} {ms[0]:5.1f} ms {ms[1]:5.1f} ms")
    print(f"  {'total':<10} {total[0]:5.1f} ms {total[1]:5.1f} ms")


if __name__ == "__main__":
    main()
