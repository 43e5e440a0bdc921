"""GPU preview check: run the NVPTX kernels on an NVIDIA GPU against the CPU kernels.

    PYTHONPATH=src python benchmarks/gpu_check.py            # on a machine with a CUDA GPU
    PYTHONPATH=src python benchmarks/gpu_check.py --assemble # anywhere with ptxas on PATH

Default: loads the PTX (``kernel.nvptx``) of the Q4_1 matmuls (auto and exact; GEMV and a
5-row batch), RMSNorm and the sampling reductions through ``core.cuda_driver``, runs them
on random inputs in device memory and compares with the CPU's generic backend (same
8-lane programs): ``auto`` matmuls must be bitwise equal (exact integer sums, the same
fma/mul order), the others within 1e-3 of the largest |reference| value; prints a table
with the time per launch. Exits 2 with the reason when no CUDA device is usable.

``--assemble``: lowers every kernel the device needs (``nvptx.device_kernels``) and
assembles each with NVIDIA's ``ptxas`` for ``--arch`` (registers, spills, stack per
entry) -- the PTX validation CI cannot do without the toolkit.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dynalm.core import cuda_driver, elementwise
from dynalm.core.matmul import QuantMatmul
from dynalm.kernel import backends, nvptx, sampling
from dynalm.kernel import elementwise as ew_programs
from dynalm.kernel.matmul import MATMUL, N_ARGS

Q4_1 = 3


def assemble(arch: str) -> int:
    ptxas = shutil.which("ptxas")
    if not ptxas:
        print("ptxas not found on PATH (it comes with the CUDA toolkit)")
        return 2
    print(f"{'kernel':<58} {'lower s':>7} {'PTX kB':>7} {'ptxas':>6} {'regs':>5} {'spill B':>8}")
    failed = 0
    for program, spec in nvptx.device_kernels():
        t0 = time.perf_counter()
        lowered = nvptx.NVPTX.lower(program, spec)
        seconds = time.perf_counter() - t0
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(lowered.ptx)
            f.flush()
            run = subprocess.run(
                [ptxas, f"-arch={arch}", "-v", f.name, "-o", "/dev/null"],
                capture_output=True,
                text=True,
            )
        regs = max(map(int, re.findall(r"Used (\d+) registers", run.stderr)), default=0)
        spills = sum(map(int, re.findall(r"(\d+) bytes spill stores", run.stderr)))
        ok = "ok" if run.returncode == 0 else "FAIL"
        failed += run.returncode != 0
        name = f"{program.name} " + " ".join(f"{k}={v}" for k, v in spec.items())
        print(f"{name[:58]:<58} {seconds:7.2f} {len(lowered.ptx) / 1e3:7.0f} {ok:>6} "
              f"{regs:5d} {spills:8d}")  # fmt: skip
        if run.returncode:
            print(run.stderr.strip()[-2000:])
    print(f"{len(nvptx.device_kernels())} modules, {failed} rejected by ptxas ({arch})")
    return 1 if failed else 0


class Gpu:
    """A context and helpers to mirror a CPU argument block into device memory."""

    def __init__(self) -> None:
        self.ctx = cuda_driver.Context(cuda_driver.load())
        self.modules: dict[int, tuple[nvptx.PtxModule, cuda_driver.Module]] = {}

    def function(self, program: backends.Program, spec: dict, short: str) -> tuple:
        lowered = nvptx.NVPTX.lower(program, spec)
        key = id(lowered)
        if key not in self.modules:
            what = f"{program.name} {spec}"
            self.modules[key] = (lowered, self.ctx.load_ptx(lowered.ptx, what))
        entry = lowered.entries[short]
        return self.modules[key][1].function(entry.name), entry

    def upload(self, arrays: list[np.ndarray]) -> dict[int, cuda_driver.DeviceArray]:
        """Device copies of ``arrays`` by their host addresses."""
        return {a.ctypes.data: self.ctx.to_device(a) for a in arrays}

    def block(self, words: np.ndarray, devices: dict) -> cuda_driver.DeviceArray:
        """A device copy of a CPU argument block, its words that are host addresses of
        uploaded arrays replaced by the device copies' (counts stay)."""
        moved = [devices[w].ptr if w in devices else w for w in words.tolist()]
        return self.ctx.to_device(np.array(moved, np.int64))

    def run(self, fn: object, entry: nvptx.Entry, block: int, rows: int, repeat: int) -> float:
        """Launch over ``rows``; the mean seconds per launch over ``repeat``."""
        self.ctx.launch(fn, entry.grid(rows), [block, rows])
        self.ctx.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            self.ctx.launch(fn, entry.grid(rows), [block, rows])
        self.ctx.synchronize()
        return (time.perf_counter() - t0) / repeat


def matmul_case(gpu: Gpu, mode: str, t_rows: int, n: int, k: int) -> tuple[np.ndarray, ...]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from test_matmul import activations, weights  # the kernel tests' inputs

    raw, x = weights(Q4_1, n, k), activations(t_rows, k)
    want = QuantMatmul(raw, Q4_1, k, mode=mode, backend=backends.GENERIC, threads=1)(x)
    qm = QuantMatmul(raw, Q4_1, k, mode=mode, backend=nvptx.NVPTX.twin(), threads=1)
    out = np.zeros((t_rows, n), np.float32)
    plan = qm._plan(x, out)
    # the repacked weights, x, y and (auto) the quantised activations' scratch views
    devices = gpu.upload([qm._weights, x, out, *qm._scratch.views(t_rows, k)])
    seconds = 0.0
    for _, which, args, total, _ in plan:  # auto: the quantiser, then the product
        words = np.frombuffer((ctypes.c_int64 * N_ARGS).from_address(args), np.int64)
        block = gpu.block(words, devices)
        fn, entry = gpu.function(MATMUL, qm._kernels.specs[which], "")
        seconds += gpu.run(fn, entry, block.ptr, total, 20)
    got = gpu.ctx.copy_out(devices[out.ctypes.data], np.empty_like(out))
    return got, want, seconds


def rms_norm_case(gpu: Gpu, rows: int, width: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    want = np.empty_like(x)
    elementwise.rms_norm(want, x, w, 1e-5, backend=backends.GENERIC)()
    out = np.zeros_like(x)
    bound = elementwise.rms_norm(out, x, w, 1e-5, backend=nvptx.NVPTX.twin())
    devices = gpu.upload([out, x, w])
    block = gpu.block(bound.block, devices)
    fn, entry = gpu.function(ew_programs.PROGRAMS["rms_norm"], bound._params, "rms_norm")
    seconds = gpu.run(fn, entry, block.ptr, rows, 20)
    return gpu.ctx.copy_out(devices[out.ctypes.data], np.empty_like(out)), want, seconds


def sampling_case(gpu: Gpu, rows: int, vocab: int) -> tuple[np.ndarray, ...]:
    logits = (np.random.default_rng(2).standard_normal((rows, vocab)) * 4).astype(np.float32)
    outs = [np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.zeros(rows, np.float32)]
    words = np.array([a.ctypes.data for a in (logits, *outs)], np.int64)
    devices = gpu.upload([logits, *outs])
    block = gpu.block(words, devices)
    fn, entry = gpu.function(sampling.ROW_REDUCE, {"vocab": vocab}, "")
    seconds = gpu.run(fn, entry, block.ptr, rows, 20)
    got = [gpu.ctx.copy_out(devices[o.ctypes.data], np.empty_like(o)) for o in outs]
    m, arg, s = sampling.reference(logits)
    return np.concatenate([got[0], got[1], got[2]]), np.concatenate([m, arg, s]), seconds


def on_gpu() -> int:
    reason = cuda_driver.probe()
    if reason:
        print(f"no CUDA device usable: {reason}")
        return 2
    gpu = Gpu()
    dev = gpu.ctx.device
    print(f"device: {dev.name}, {dev.total_memory / 2**30:.1f} GiB, {dev.sm}")
    cases = [
        (
            f"mm Q4_1 {mode} {t}x576 -> 1536",
            "bitwise" if mode == "auto" else "1e-3",
            functools.partial(matmul_case, gpu, mode, t, 1536, 576),
        )
        for mode in ("auto", "exact")
        for t in (1, 5)
    ] + [
        ("rms_norm 8x576", "1e-3", lambda: rms_norm_case(gpu, 8, 576)),
        ("sample_reduce 4x49152", "1e-3", lambda: sampling_case(gpu, 4, 49152)),
    ]  # fmt: skip
    print(f"{'kernel':<36} {'check':>8} {'result':>7} {'max rel err':>12} {'us/launch':>10}")
    failed = 0
    for name, rule, case in cases:
        got, want, seconds = case()
        scale = float(np.max(np.abs(want))) or 1.0
        err = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
        ok = np.array_equal(got, want) if rule == "bitwise" else err <= 1e-3
        failed += not ok
        print(f"{name:<36} {rule:>8} {'ok' if ok else 'FAIL':>7} {err:12.2e} {seconds * 1e6:10.1f}")
    gpu.ctx.close()
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assemble", action="store_true", help="ptxas every device kernel")
    parser.add_argument("--arch", default=nvptx.SM, help="ptxas -arch (default %(default)s)")
    args = parser.parse_args()
    return assemble(args.arch) if args.assemble else on_gpu()


if __name__ == "__main__":
    sys.exit(main())
