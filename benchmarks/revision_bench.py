"""`dynalm bench` of this tree against another git revision, side by side in one run.

Each round runs ``dynalm bench MODEL -p P -n N -r R --json`` once per tree, in a fresh
process each, the order alternating from round to round (a run after another is slowed or
sped up by what ran before it on a busy machine); prints every round's rates and, per test,
the medians and their ratio (this tree / the baseline).

    python benchmarks/revision_bench.py MODEL --baseline REV [--rounds 6] [-p 512] [-n 128]
        [-r 3] [-- other bench flags, e.g. --mode exact]
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

ROOT = Path(__file__).resolve().parents[1]


def bench(src: str, model: str, flags: list[str]) -> dict[str, float]:
    """tokens/s per test (pp512, tg128, ...) of one ``dynalm bench`` run of the tree at ``src``."""
    env = dict(os.environ, PYTHONPATH=src)
    run = subprocess.run(
        [sys.executable, "-m", "dynalm.cli", "bench", model, *flags, "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise SystemExit(f"bench of {src} failed:\n{run.stderr[-2000:]}")
    return {r["test"]: r["tokens_per_s"] for r in json.loads(run.stdout)["results"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--baseline", metavar="REV", required=True, help="the git revision to compare")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-p", default="512", help="prompt sizes (bench -p)")
    ap.add_argument("-n", default="128", help="decode lengths (bench -n)")
    ap.add_argument("-r", default="3", help="timed runs per bench process (bench -r)")
    ap.add_argument("rest", nargs="*", help="more bench flags (after --)")
    args = ap.parse_args()
    flags = ["-p", args.p, "-n", args.n, "-r", args.r, *args.rest]
    with tempfile.TemporaryDirectory() as tmp:
        base = str(checkout(args.baseline, Path(tmp)))
        trees = {"this tree": str(ROOT / "src"), args.baseline: base}
        rates: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for i in range(args.rounds):
            order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
            for name, src in order:
                for test, rate in bench(src, args.model, flags).items():
                    rates[name].setdefault(test, []).append(rate)
            line = "  ".join(
                f"{name}: " + " ".join(f"{t} {v[-1]:.1f}" for t, v in rates[name].items())
                for name in trees
            )
            print(f"round {i + 1}: {line}", flush=True)
    print(f"\n| test | this tree t/s | {args.baseline} t/s | ratio | every round (this / base) |")
    print("|---|---|---|---|---|")
    for test, mine in rates["this tree"].items():
        base = rates[args.baseline][test]
        a, b = statistics.median(mine), statistics.median(base)
        each = " ".join(f"{x:.0f}/{y:.0f}" for x, y in zip(mine, base, strict=True))
        print(f"| {test} | {a:.1f} | {b:.1f} | {a / b:.3f} | {each} |")


if __name__ == "__main__":
    main()
