"""GPU preview check: the CUDA device's kernels and a model on an NVIDIA GPU, against the CPU.

    PYTHONPATH=src python benchmarks/gpu_check.py                     # kernels
    PYTHONPATH=src python benchmarks/gpu_check.py --fidelity MODEL    # a model, GPU vs CPU
    PYTHONPATH=src python benchmarks/gpu_check.py --assemble          # anywhere with ptxas
    ... --emulate                     # either check on this CPU (tests/cuda_emulator.py)

Default: loads the PTX (``kernel.nvptx``) of the Q4_1 matmuls (auto and exact; GEMV, a
5-row batch and a 21-row one: auto's tensor-core mma tiles), RMSNorm and the sampling
reductions through ``core.cuda_device``, runs them on random inputs in device memory and
compares with the CPU's generic backend (same 8-lane programs): ``auto`` matmuls must be
bitwise equal (exact integer sums, the same fma/mul order), the others within 1e-3 of
the largest |reference| value; prints a table with the time per launch. Exits 2 with the
reason when no CUDA device is usable.

``--fidelity MODEL [MODEL ...]``: each model's logits on the GPU (``CudaDevice``) and the
CPU, per mode, at every position of three prompts and one decode step: top-1 must agree and
the logits lie within two fp32 passes' rounding (``tests/tolerances.forward_bound``); whether
they are within 1e-3 is printed beside. A model the GPU cannot run (an op or a weight format
its kernels do not take, ``ir.lower.unsupported``, or a refusal while binding) is one line
naming the model and the reason, and the check goes on to the next; any such model or
failed comparison makes the exit status 1. Per mode, the driver launches a decode step makes
(one: a CUDA graph) and the kernels it runs. Decode speed on the GPU:
``dynalm bench MODEL --gpu``.

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
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.cuda_device import CudaDevice
from dynalm.core.matmul import QuantMatmul
from dynalm.errors import DynaError, UnsupportedModel
from dynalm.kernel import backends, nvptx
from dynalm.kernel import sampling_program as sampling
from dynalm.kernel.matmul_programs import MATMUL, N_ARGS

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


TESTS = Path(__file__).resolve().parents[1] / "tests"


def _tests_on_path() -> None:
    """The test helpers this script shares: kernel inputs, tolerances, the emulator."""
    for folder in (TESTS, TESTS / "kernels", TESTS / "models"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def make_device(mode: str, emulate: bool) -> CudaDevice:
    """The CUDA device (``--emulate``: on this CPU, through ``tests/cuda_emulator.py``)."""
    if not emulate:
        return CudaDevice(mode)
    _tests_on_path()
    from cuda_emulator import EmulatedLibcuda

    return CudaDevice(mode, driver=cuda_driver.Driver(EmulatedLibcuda()))


class Gpu:
    """Launches of single kernels on a ``CudaDevice``: CPU argument blocks moved to the
    device (their words that are addresses of mirrored arrays replaced by the copies')."""

    def __init__(self, device: CudaDevice) -> None:
        self.device, self.ctx = device, device.context

    def block(self, words: np.ndarray, arrays: list[np.ndarray]) -> cuda_driver.DeviceArray:
        """``words`` in device memory (held as long as this object), ``arrays`` mirrored."""
        for a in arrays:
            self.device.mirror(a)
        moved = []
        for word in words.tolist():
            found = self.device.mirrored(word)
            moved.append(found[0].ptr + found[1] if found else word)
        block = self.device.alloc(8 * len(moved), owner=self)
        self.ctx.copy_in(block, np.array(moved, np.int64))
        return block

    def fetch(self, host: np.ndarray) -> np.ndarray:
        copy, offset = self.device.device_view(host)
        return self.ctx.copy_out(copy, np.empty_like(host), offset)

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
    _tests_on_path()
    from test_matmul import activations, weights  # the kernel tests' inputs

    raw, x = weights(Q4_1, n, k), activations(t_rows, k)
    want = QuantMatmul(raw, Q4_1, k, mode=mode, backend=backends.GENERIC, threads=1)(x)
    qm = QuantMatmul(raw, Q4_1, k, mode=mode, backend=nvptx.NVPTX.twin(), threads=1)
    out = np.zeros((t_rows, n), np.float32)
    plan = qm.kernel_calls(x, out)
    # the repacked weights, x, y and (auto) the quantised activations' scratch
    arrays = [qm._weights, x, out, qm._scratch._buffer]
    seconds = 0.0
    for which, args, total in plan:  # auto: the quantiser, then the product's tiles
        words = np.frombuffer((ctypes.c_int64 * N_ARGS).from_address(args), np.int64).copy()
        block = gpu.block(words, arrays)
        fn, entry = gpu.device.function(MATMUL, qm._kernels.specs[which], "")
        seconds += gpu.run(fn, entry, block.ptr, total, 20)
    return gpu.fetch(out), want, seconds


def rms_norm_case(gpu: Gpu, rows: int, width: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    want = np.empty_like(x)
    elementwise.rms_norm(want, x, w, 1e-5, backend=backends.GENERIC)()
    out = np.zeros_like(x)
    bound = elementwise.rms_norm(out, x, w, 1e-5, backend=nvptx.NVPTX.twin())
    block = gpu.block(bound.block.copy(), [out, x, w])
    _, program, spec = bound.request
    fn, entry = gpu.device.function(program, spec, "rms_norm")
    seconds = gpu.run(fn, entry, block.ptr, rows, 20)
    return gpu.fetch(out), want, seconds


def sampling_case(gpu: Gpu, rows: int, vocab: int) -> tuple[np.ndarray, ...]:
    logits = (np.random.default_rng(2).standard_normal((rows, vocab)) * 4).astype(np.float32)
    outs = [np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.zeros(rows, np.float32)]
    words = np.array([a.ctypes.data for a in (logits, *outs)], np.int64)
    block = gpu.block(words, [logits, *outs])
    fn, entry = gpu.device.function(sampling.ROW_REDUCE, {"vocab": vocab}, "")
    seconds = gpu.run(fn, entry, block.ptr, rows, 20)
    got = [gpu.fetch(o) for o in outs]
    m, arg, s = sampling.reference(logits)
    return np.concatenate([got[0], got[1], got[2]]), np.concatenate([m, arg, s]), seconds


def kernels(emulate: bool) -> int:
    gpu = Gpu(make_device("auto", emulate))
    dev = gpu.ctx.device
    print(f"device: {dev.name}, {dev.total_memory / 2**30:.1f} GiB, {dev.sm}")
    cases = [
        (
            f"mm Q4_1 {mode} {t}x576 -> 1536",
            "bitwise" if mode == "auto" else "1e-3",
            functools.partial(matmul_case, gpu, mode, t, 1536, 576),
        )
        for mode in ("auto", "exact")
        for t in (1, 5, 21)  # 21 rows: auto's tensor-core mma tiles (16 and more)
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
    return 1 if failed else 0


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which plants turn light, water and carbon dioxide",
]


def fidelity(model_paths: list[str], emulate: bool) -> int:
    """Each model on the GPU against the CPU in each mode: every prompt position's logits
    and one decode step's (f32 KV). Top-1 must agree everywhere and the logits lie within
    two fp32 passes' rounding (``tests/tolerances.forward_bound``; the issue's 1e-3 is
    printed beside it). A model the GPU cannot run is a line saying why; 1 if any failed."""
    print(f"{'mode':<6} {'prompt':<28} {'top-1':>7} {'max |d|':>9} {'of bound':>9} "
          f"{'<=1e-3':>7} {'gpu s':>7} {'cpu s':>7}")  # fmt: skip
    failed = 0
    for path in model_paths:
        try:
            failed += compare_model(path, emulate)
        except (DynaError, NotImplementedError) as e:  # what the device cannot run
            print(f"{path}: not run on the GPU: {e}")
            failed += 1
    return 1 if failed else 0


def step_launches(device: CudaDevice) -> str:
    """What a batch-1 decode step costs in driver calls: one CUDA graph launch."""
    if (1, 1) not in device.submitted:
        return "decode step: not run"
    launches, kernels = device.submitted[1, 1]
    how = "one CUDA graph" if launches < kernels else "launched one by one"
    return f"decode step: {launches} launch(es) per step, {kernels} kernels ({how})"


def compare_model(model_path: str, emulate: bool) -> int:
    """The rows of ``fidelity``'s table for one model; the number of failed rows."""
    _tests_on_path()
    from test_cuda_device import forward

    from dynalm.ir.lower import unsupported
    from dynalm.models.loader import load_model
    from tolerances import forward_bound, logit_scale

    model = load_model(model_path)
    hp = model.hparams
    print(f"{model_path}:")
    failed = 0
    for mode in ("exact", "auto"):
        gpu, cpu = make_device(mode, emulate), CpuDevice(mode)
        why = unsupported(gpu, model.graph)
        if why is not None:  # what --backend auto would run on the CPU instead
            raise UnsupportedModel(f"{hp.arch} graph, mode {mode}: {why}")
        for text in PROMPTS:
            ids = model.tokenizer.encode(text, add_special=True)
            t0 = time.perf_counter()
            got = forward(model, gpu, ids)
            t1 = time.perf_counter()
            want = forward(model, cpu, ids)
            t2 = time.perf_counter()
            bound = forward_bound(hp.n_layers, max(hp.d_ff, hp.d_model), logit_scale(want))
            diff = np.abs(got - want)
            top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
            ok = top1 == 1.0 and bool((diff <= bound).all())
            failed += not ok
            print(f"{mode:<6} {text[:28]!r:<28} {top1:7.1%} {diff.max():9.2e} "
                  f"{(diff / bound).max():9.2f} {str(diff.max() <= 1e-3):>7} "
                  f"{t1 - t0:7.2f} {t2 - t1:7.2f}{'' if ok else '  FAIL'}")  # fmt: skip
        print(f"{mode:<6} {step_launches(gpu)}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assemble", action="store_true", help="ptxas every device kernel")
    parser.add_argument("--arch", default=nvptx.SM, help="ptxas -arch (default %(default)s)")
    parser.add_argument(
        "--fidelity", metavar="MODEL", nargs="+", help="GGUF models: GPU vs CPU logits"
    )
    parser.add_argument(
        "--emulate", action="store_true", help="run on this CPU (tests/cuda_emulator.py)"
    )
    args = parser.parse_args()
    if args.assemble:
        return assemble(args.arch)
    reason = None if args.emulate else cuda_driver.probe()
    if reason:
        print(f"no CUDA device usable: {reason}")
        return 2
    return fidelity(args.fidelity, args.emulate) if args.fidelity else kernels(args.emulate)


if __name__ == "__main__":
    sys.exit(main())
