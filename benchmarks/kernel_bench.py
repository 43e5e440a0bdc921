"""Kernel micro-benchmarks: each matmul kernel x backend x shape of a real model, next to
the host's measured peaks, with compile times; ``--baseline REV`` compares another git
revision in the same run.

Shapes are a model's matmuls (``--model``: SmolLM2-135M, the default, with Q4_1 layers and
a Q8_0 tied output; or the real-size shapes of ``benchmarks/real_size.py``: Llama-3.2-1B
and 3B, Llama-3.1-8B, Qwen2.5-1.5B, with Q4_0 layers and a Q6_K output as llama.cpp's
quantiser writes them; ``--format`` and ``--output-format`` swap them) with random weights
in the real layouts. Per backend (every one this CPU runs natively, or ``--backends``) and
mode, per shape and batch (T = 1: GEMV, the decode step; T = 8: a batched decode step; T =
128 or 512: a prefill chunk): the best time of repeated calls, weight GB/s (bytes of the
GGUF weight / time) and GMAC/s (T x N x K / time), each as a share of the host's peak
(GB/s: of the streaming read at this thread count; GMAC/s: of the variant's backend's
int8 multiply rate, "% mul", multiply-and-widen rate, "% dot", and auto-cell rate, "% cell").
A weight that fits in the L3 cache is read from it when a call repeats, so the GEMV (T = 1)
is timed twice: repeated (row "1"), and as a decode step reads it (row "1 dram"): over
enough copies of the weight, called in turn, to pass ``DRAM_SPAN`` times the host's L3
(sysfs), every call reading its copy from memory; that row's GB/s is what a decode step
streams.

Peaks (kernel programs of their own, ``dynalm.kernel.probes``): the streaming-read
bandwidth of 1 and all threads over 256 MiB, and each backend's int8 multiply rate
(on AVX2 ``vpmaddubsw`` into int16) and multiply-and-widen rate (``dot_u8s8``: on AVX2
``vpmaddubsw`` + ``vpmaddwd``) on registers, 1 and all threads, and the rate of ``auto``'s
cell arithmetic alone (``INT8_CELL``: the products, their int16 sums and widening, the
converts and float scaling of a 32-block, no memory: what an int8 kernel with ``auto``'s
numerics reaches at best). Compile time: every
kernel the table used, lowered in a fresh process with an empty JIT cache (median and the
slowest).

Every variant runs in a worker process of its own (``--worker``, the revision's ``src``
on its path, an empty JIT cache); jobs are sent to the workers in turn, so machine noise
hits the revisions alike. ``--baseline REV`` adds a worker for git revision REV (its
default kernels; revisions before DynaKernel know no backends).

    python benchmarks/kernel_bench.py [--model smollm2|1b|3b|8b|qwen2-1.5b] [--threads 2]
        [--backends avx512,avx2] [--modes auto,exact] [--batches 1,8,128] [--format q4_1]
        [--output-format q8_0] [--baseline REV] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[1]
# (name, N, K) of SmolLM2-135M's matmuls: 30 layers, tied 49152-token output.
SMOLLM2 = [
    ("attn_q/o", 576, 576),
    ("attn_k/v", 192, 576),
    ("ffn_gate/up", 1536, 576),
    ("ffn_down", 576, 1536),
    ("output", 49152, 576),
]
# --model: (shapes, layer format, output format)
MODELS = {"smollm2": (SMOLLM2, "q4_1", "q8_0")}


def model_shapes(model: str) -> tuple[list[tuple[str, int, int]], str, str]:
    if model in MODELS:
        return MODELS[model]
    from real_size import MODELS as REAL

    if model not in REAL:
        raise SystemExit(f"unknown model {model!r}: choose from {', '.join([*MODELS, *REAL])}")
    m = REAL[model]
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    shapes = [
        ("attn_q", q, m.d_model),
        ("attn_k/v", kv, m.d_model),
        ("attn_output", m.d_model, q),
        ("ffn_gate/up", m.d_ff, m.d_model),
        ("ffn_down", m.d_model, m.d_ff),
        ("output", m.vocab, m.d_model),
    ]
    return shapes, "q4_0", "q6_k"


# --- the worker: runs jobs with whatever dynalm is on its path ---------------------------


def worker() -> None:
    """Answer one JSON job per stdin line with one JSON result per stdout line."""
    from dynalm.core.matmul import QuantMatmul
    from dynalm.core.quant import quant_format, random_blocks

    has_backends = "backend" in inspect.signature(QuantMatmul).parameters
    rng = np.random.default_rng(0)
    built: dict[tuple, tuple] = {}
    raw_of: dict[tuple, tuple] = {}  # the GGUF rows and options of each built matmul
    seen: set[int] = set()
    for line in sys.stdin:
        job = json.loads(line)
        key = (job["type"], job["n"], job["k"], job["mode"], job["isa"], job["threads"])
        if key not in built:
            fmt = quant_format(job["type"])
            raw = random_blocks(job["type"], job["n"] * job["k"] // fmt.block_size, rng)
            kw = {"mode": job["mode"], "threads": job["threads"]}
            if has_backends and job["isa"]:
                from dynalm.kernel import backends

                kw["backend"] = backends.by_name(job["isa"])
            mm = QuantMatmul(raw.reshape(job["n"], -1), job["type"], job["k"], **kw)
            built[key] = (mm, raw.nbytes, {})
            raw_of[key] = (raw.reshape(job["n"], -1), kw)
        mm, nbytes, arrays = built[key]
        t = job["t"]
        if t not in arrays:
            x = rng.standard_normal((t, job["k"])).astype(np.float32)
            arrays[t] = (x, np.empty((t, job["n"]), np.float32))
            mm(*arrays[t])  # first call: lowers (compiles) the kernel for this batch
        x, y = arrays[t]
        if job.get("dram"):
            best = from_memory(mm, raw_of[key], x, y, job)
        else:
            best = float("inf")
            for _ in range(job["repeat"]):
                t0 = time.perf_counter()
                mm(x, y)
                best = min(best, time.perf_counter() - t0)
        # Compile times of the kernels this job lowered first (revisions with DynaKernel).
        lowered = [d for d in getattr(getattr(mm, "_kernels", None), "_done", []) if d]
        compiled = [d.compile_seconds for d in lowered if id(d) not in seen and d.compile_seconds]
        seen.update(id(d) for d in lowered)
        print(json.dumps({"seconds": best, "bytes": nbytes, "compile": compiled}), flush=True)


# The "dram" GEMV row's copies of a weight span this many times the L3 cache, so that a
# copy is long evicted when its turn comes again.
DRAM_SPAN = 4


def l3_bytes() -> int:
    """The largest cache this CPU reports (sysfs; 32 MiB where it reports none)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 << 20)


def from_memory(mm, raw_kw: tuple, x: np.ndarray, y: np.ndarray, job: dict) -> float:
    """Seconds per call of ``mm``'s product when its weight comes from memory: copies of
    the weight (repacked again, one matmul each) called in turn, best of ``repeat`` // 4
    rounds (at least 2) over all copies. Each copy writes its own output (a shared one
    would stay in cache for the others). As native programs where the revision has them
    (no Python between calls, as in a decode step), else call by call."""
    from dynalm.core.matmul import QuantMatmul

    raw, kw = raw_kw
    nbytes = raw.nbytes
    copies = max(1, -(-DRAM_SPAN * l3_bytes() // nbytes))
    mms = [mm] + [QuantMatmul(raw, job["type"], job["k"], **kw) for _ in range(copies - 1)]
    outs = [y] + [np.empty_like(y) for _ in range(copies - 1)]
    for m, out in zip(mms, outs, strict=True):
        m(x, out)
    try:
        from dynalm.core import pool

        records = [r for m, out in zip(mms, outs, strict=True) for r in m.records(x, out)]
        run = pool.Program(records, job["threads"])
    except (ImportError, AttributeError):  # a revision without native programs

        def run() -> None:
            for m, out in zip(mms, outs, strict=True):
                m(x, out)

    best = float("inf")
    for _ in range(max(2, job["repeat"] // 4)):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best / copies


class Worker:
    def __init__(self, label: str, src: Path, threads: int) -> None:
        self.label = label
        self.cache = tempfile.TemporaryDirectory(prefix="dynalm-bench-jit-")
        env = {**os.environ, "PYTHONPATH": str(src), "DYNALM_CACHE": self.cache.name}
        env["DYNALM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}: worker died on {job}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.cache.cleanup()


def checkout(rev: str, into: Path) -> Path:
    """``src/`` of git revision ``rev``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


# --- peaks -----------------------------------------------------------------------------

# the int8 probes' rates, report key -> what it measures ("% mul", "% dot", "% cell")
PEAK_KEYS = {
    "int8_mul_gmacs": "multiply",
    "int8_gmacs": "multiply+widen",
    "int8_cell_gmacs": "auto cell",
}


def peaks(backend_names: list[str], threads: int) -> dict:
    """Streaming-read GB/s (1 and ``threads`` threads) and int8 GMAC/s per backend."""
    from dynalm.core import pool
    from dynalm.core.cpu_device import streaming_read_gbs
    from dynalm.kernel import backends, jit, probes

    signature = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

    def run(fn: int, args: np.ndarray, total: int, n: int) -> float:
        at = args.__array_interface__["data"][0]
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            if n > 1:
                pool.pool(n).run(fn, at, total, -(-total // n))
            else:
                jit.cfunc(fn, None, *signature)(at, 0, total)
            best = min(best, time.perf_counter() - t0)
        return best

    out: dict = {"stream_gbs": {}, **{key: {} for key in PEAK_KEYS}}
    for n in sorted({1, threads}):
        out["stream_gbs"][n] = streaming_read_gbs(n)
    rounds = 1 << 22
    result = np.zeros(threads, np.int32)
    for name in backend_names:
        b = backends.by_name(name)
        for key, program in zip(
            PEAK_KEYS, (probes.INT8_MUL, probes.INT8_DOT, probes.INT8_CELL), strict=True
        ):
            fn = b.lower(program, {}).addresses[""]
            dot_args = np.array([0, result.ctypes.data], np.int64)
            per = {}
            for n in sorted({1, threads}):
                seconds = run(fn, dot_args, rounds * n, n)
                per[n] = rounds * n * probes.macs_per_round(b.lanes, program) / seconds / 1e9
            out[key][b.name] = per
    return out


# --- the driver --------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="whose matmul shapes (see above)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", help="comma-separated ISAs (default: all native here)")
    ap.add_argument("--modes", default="auto,exact")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--format", help="layer weight format (default: the model's)")
    ap.add_argument("--output-format", help="output weight format (default: the model's)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--baseline", metavar="REV", help="also run git revision REV's kernels")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return

    from dynalm.core.matmul import AUTO_VALIDATED
    from dynalm.kernel import backends

    isas = (
        args.backends.split(",")
        if args.backends
        else [b.isa for b in backends.BACKENDS if not b.missing()]
    )
    shapes, layer_format, output_format = model_shapes(args.model)
    args.format = args.format or layer_format
    args.output_format = args.output_format or output_format
    layer_type = int(GGMLQuantizationType[args.format.upper()])
    output_type = int(GGMLQuantizationType[args.output_format.upper()])
    modes, batches = args.modes.split(","), [int(t) for t in args.batches.split(",")]

    tmp = tempfile.TemporaryDirectory(prefix="dynalm-bench-src-")
    workers = [Worker("this tree", ROOT / "src", args.threads)]
    if args.baseline:
        workers.append(Worker(args.baseline, checkout(args.baseline, Path(tmp.name)), args.threads))
    variants = [(w, isa) for w in workers[:1] for isa in isas]
    variants += [(w, "") for w in workers[1:]]  # a baseline runs its own default kernels

    rows, compile_times = [], []
    for mode in modes:
        for name, n, k in shapes:
            ggml_type = output_type if name == "output" else layer_type
            kernel_mode = mode if ggml_type in AUTO_VALIDATED else "exact"
            runs = [(t, False) for t in batches] + [(1, True)] * (1 in batches)
            for t, dram in runs:
                if name == "output" and t > 1:
                    continue  # logits are taken for each sequence's last token only
                job = {"type": ggml_type, "n": n, "k": k, "t": t, "mode": kernel_mode}
                job |= {"threads": args.threads, "repeat": args.repeat, "dram": dram}
                results = [w.run({**job, "isa": isa}) for w, isa in variants]
                for (w, isa), r in zip(variants, results, strict=True):
                    label = w.label if not isa else f"{w.label} {backends.by_name(isa).name}"
                    compile_times += r["compile"] or []
                    rows.append(
                        {
                            "variant": label,
                            "backend": backends.by_name(isa).name if isa else None,
                            "mode": kernel_mode,
                            "shape": name,
                            "n": n,
                            "k": k,
                            "t": t,
                            "dram": dram,
                            "us": r["seconds"] * 1e6,
                            "gbs": r["bytes"] / r["seconds"] / 1e9,
                            "gmacs": t * n * k / r["seconds"] / 1e9,
                        }
                    )
    for w in workers:
        w.close()
    tmp.cleanup()
    report = {
        "model": args.model,
        "threads": args.threads,
        "format": args.format,
        "output_format": args.output_format,
        "peaks": peaks(isas, args.threads),
        "compile_ms": {
            "kernels": len(compile_times),
            "median": 1e3 * statistics.median(compile_times) if compile_times else None,
            "max": 1e3 * max(compile_times) if compile_times else None,
        },
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print_report(report)


def print_report(r: dict) -> None:
    p = r["peaks"]
    stream = ", ".join(f"{n} thread(s) {v:.1f} GB/s" for n, v in p["stream_gbs"].items())
    print(f"peaks: streaming read {stream}")
    for name in p["int8_mul_gmacs"]:
        for key, what in PEAK_KEYS.items():
            rates = p[key][name]
            each = ", ".join(f"{n} thread(s) {v:.0f}" for n, v in rates.items())
            print(f"       int8 {what} {name}: {each} GMAC/s")
    c = r["compile_ms"]
    if c["kernels"]:
        print(
            f"compile (empty cache): {c['kernels']} kernels, median {c['median']:.0f} ms, ", end=""
        )
        print(f"slowest {c['max']:.0f} ms")
    stream_peak = p["stream_gbs"][r["threads"]]
    int8_peaks = {
        name: tuple(p[key][name][r["threads"]] for key in PEAK_KEYS) for name in p["int8_mul_gmacs"]
    }
    best = next(iter(int8_peaks.values()))  # a baseline revision runs the host's best
    print(
        f"\n{r['model']}: {r['format']} layers + {r['output_format']} output, "
        f"{r['threads']} threads, best of repeats (a weight that fits in L3 is read from it "
        "when repeated: GB/s above the streaming peak; T = '1 dram': the GEMV with its "
        "weight read from memory, as in a decode step)\n"
    )
    print(
        "| mode | shape | N x K | T | variant | us | GB/s | % stream | GMAC/s | % mul | % dot "
        "| % cell | x first |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    first: dict[tuple, float] = {}
    for row in r["rows"]:
        t = f"{row['t']} dram" if row.get("dram") else str(row["t"])
        key = (row["mode"], row["shape"], t)
        base = first.setdefault(key, row["us"])
        mul, dot, cell = int8_peaks.get(row.get("backend"), best)
        print(
            f"| {row['mode']} | {row['shape']} | {row['n']}x{row['k']} | {t} | "
            f"{row['variant']} | {row['us']:.1f} | {row['gbs']:.1f} | "
            f"{100 * row['gbs'] / stream_peak:.0f} | {row['gmacs']:.1f} | "
            f"{100 * row['gmacs'] / mul:.0f} | {100 * row['gmacs'] / dot:.0f} | "
            f"{100 * row['gmacs'] / cell:.0f} | "
            f"{base / row['us']:.2f} |"
        )


if __name__ == "__main__":
    main()
