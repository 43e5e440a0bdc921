"""core.cuda_driver without a GPU: the no-driver reason, and error messages formed from the
driver's own names and descriptions (a fake library object returning CUresult codes)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dynalm.core import cuda_driver, devices
from dynalm.kernel import nvptx

ERRORS = {
    100: (b"CUDA_ERROR_NO_DEVICE", b"no CUDA-capable device is detected"),
    218: (b"CUDA_ERROR_INVALID_PTX", b"a PTX JIT compilation failed"),
    2: (b"CUDA_ERROR_OUT_OF_MEMORY", b"out of memory"),
}


class FakeLibcuda:
    """Answers like libcuda: ``results`` maps a function to the CUresult it returns
    (0 when absent); cuModuleLoadDataEx writes ``ptx_log`` into the error log buffer."""

    def __init__(self, results: dict[str, int], ptx_log: bytes = b"") -> None:
        self.results, self.ptx_log, self.calls = results, ptx_log, []

    def cuGetErrorName(self, code: int, out: object) -> int:  # noqa: N802 (the C name)
        if code not in ERRORS:
            return 1  # CUDA_ERROR_INVALID_VALUE, as the driver answers an unknown code
        out._obj.value = ERRORS[code][0]
        return 0

    def cuGetErrorString(self, code: int, out: object) -> int:  # noqa: N802
        out._obj.value = ERRORS[code][1]
        return 0

    def cuModuleLoadDataEx(self, handle, image, n, options, values) -> int:  # noqa: N802, ANN001
        code = self.results.get("cuModuleLoadDataEx", 0)
        if code:
            at = [options[i] for i in range(n)].index(5)  # CU_JIT_ERROR_LOG_BUFFER
            ctypes.memmove(values[at], self.ptx_log, len(self.ptx_log))
        return code

    def __getattr__(self, name: str) -> object:
        def call(*args: object) -> int:
            self.calls.append(name)
            return self.results.get(name, 0)

        return call


def test_probe_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "LIBRARY", "libcuda-not-here.so.1")
    assert cuda_driver.probe() == "libcuda-not-here.so.1 not found (no NVIDIA driver)"
    # device discovery reports it as why the CUDA kind is unavailable
    cuda = next(kind for kind in devices.GPU_KINDS if kind.name == "cuda")
    assert cuda.unavailable() == "libcuda-not-here.so.1 not found (no NVIDIA driver)"
    # the NVPTX backend's code never runs on the host (the kernel layer probes no driver)
    assert nvptx.NVPTX.capabilities()["runs_here"] is False


def test_probe_reports_cuinit_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLibcuda({"cuInit": 100})
    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", lambda name: fake)
    assert cuda_driver.probe() == (
        "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"
    )


def test_probe_with_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    class OneDevice(FakeLibcuda):
        def cuDeviceGetCount(self, out: object) -> int:  # noqa: N802
            out._obj.value = 1
            return 0

    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", lambda name: OneDevice({}))
    assert cuda_driver.probe() is None


def test_failed_call_names_the_call_and_the_error() -> None:
    driver = cuda_driver.Driver(FakeLibcuda({"cuMemAlloc_v2": 2}))
    with pytest.raises(cuda_driver.CudaError) as e:
        driver.call("cuMemAlloc_v2", ctypes.byref(ctypes.c_uint64()), 1 << 40)
    assert str(e.value) == "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    assert e.value.code == 2
    assert driver.error_text(999) == "unknown CUresult 999"


def test_rejected_ptx_carries_the_driver_log() -> None:
    log = b"ptxas application ptx input, line 12; error   : Unknown symbol 'x'"
    fake = FakeLibcuda({"cuModuleLoadDataEx": 218}, ptx_log=log)
    context = cuda_driver.Context(cuda_driver.Driver(fake))
    with pytest.raises(cuda_driver.CudaError) as e:
        context.load_ptx(".version 7.5", "mm Q4_1 auto")
    assert str(e.value) == (
        "mm Q4_1 auto: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX "
        "(a PTX JIT compilation failed) -- driver log: " + log.decode()
    )


def test_launch_and_copies_reach_the_driver() -> None:
    fake = FakeLibcuda({})
    context = cuda_driver.Context(cuda_driver.Driver(fake))
    assert fake.calls[-1] == "cuCtxSetCurrent"
    array = context.to_device(np.zeros(4, np.float32))
    context.launch(ctypes.c_void_p(1), (2, 128), [array.ptr, 4])
    context.synchronize()
    context.copy_out(array, np.empty(4, np.float32))
    with pytest.raises(ValueError, match="copy into device memory: bytes 0..32 of 16"):
        context.copy_in(array, np.zeros(8, np.float32))
    assert fake.calls[-4:] == ["cuMemcpyHtoD_v2", "cuLaunchKernel", "cuCtxSynchronize",
                               "cuMemcpyDtoH_v2"]  # fmt: skip
