"""What a family's ``.lum`` file adds to model load: in a fresh process (nothing cached),
importing lark and Lumen (beyond what the loader imports anyway), loading the grammar's
tables, parsing and checking the family's file,
and elaborating it against the model's metadata and tensor types (the DynaIR graph); each
timed in its own child process, ``--repeat`` times, the median printed as CPU time of the
process (steadier than wall time on a shared machine) and wall time.

    python benchmarks/lumen_load.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
from dynalm.models.gguf_file import GGUFFile
# what model load imports anyway (the loader's other modules), so that "import" is Lumen's
import dynalm.ir.builder, dynalm.ir.passes, dynalm.models.chat_template, dynalm.models.hparams
import dynalm.models.tokenizer
gguf = GGUFFile(sys.argv[1])
clocks = (time.process_time, time.perf_counter)
t0 = [c() for c in clocks]
from dynalm.ir.lumen import Elaborator
from dynalm.ir.lumen.syntax import _parser
from dynalm.models.arch import family_file, family_program, tensor_types
t1 = [c() for c in clocks]
_parser()
t2 = [c() for c in clocks]
program = family_program(family_file(gguf.architecture))
t3 = [c() for c in clocks]
graph = Elaborator(program, gguf.architecture, gguf.metadata, tensor_types(gguf)).run()
t4 = [c() for c in clocks]
steps = {"import": (t0, t1), "tables": (t1, t2), "parse": (t2, t3), "elaborate": (t3, t4)}
print(json.dumps({
    "steps": {k: [b[i] - a[i] for i in range(2)] for k, (a, b) in steps.items()},
    "nodes": len(graph.nodes), "file": str(family_file(gguf.architecture)),
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    runs = [
        json.loads(subprocess.check_output([sys.executable, "-c", CHILD, args.model], text=True))
        for _ in range(args.repeat)
    ]
    print(f"{runs[0]['file']}: a graph of {runs[0]['nodes']} nodes (median of {args.repeat})")
    print(f"  {'':<10} {'cpu':>8} {'wall':>8}")
    total = [0.0, 0.0]
    for step in runs[0]["steps"]:
        ms = [1000 * statistics.median(r["steps"][step][i] for r in runs) for i in range(2)]
        total = [t + m for t, m in zip(total, ms, strict=True)]
        print(f"  {step:<10} {ms[0]:5.1f} ms {ms[1]:5.1f} ms")
    print(f"  {'total':<10} {total[0]:5.1f} ms {total[1]:5.1f} ms")


if __name__ == "__main__":
    main()
