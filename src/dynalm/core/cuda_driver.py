"""The CUDA driver API through ctypes (``libcuda.so.1``): what the GPU preview needs to
load PTX (``kernel.nvptx``) and run it.

``probe()`` says in one line why no CUDA device is usable (None when one is). A
:class:`Driver` wraps the library: every call's result is checked, and a failure raises
:class:`CudaError` naming the call, the error's name and its description
(``cuGetErrorName`` / ``cuGetErrorString``). :class:`Context` holds the primary context of
one device: PTX modules (``cuModuleLoadDataEx`` with an error log buffer, so a PTX the
driver rejects is reported with the driver's log), functions, device memory, copies,
launches, synchronisation, and CUDA graphs (``capture``: a stream's launches recorded once,
replayed by one ``cuGraphLaunch``).

Nothing here has run on a GPU (no NVIDIA driver where DynaLM was built): it is a preview.
CI runs it against an emulated driver (``tests/cuda_emulator.py``, behind
``core.cuda_device``); ``benchmarks/gpu_check.py`` exercises it where a GPU is present.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

LIBRARY = "libcuda.so.1"
_LOG_BYTES = 16384
# CUjit_option values (cuda.h)
_JIT_INFO_LOG_BUFFER, _JIT_INFO_LOG_BUFFER_SIZE_BYTES = 3, 4
_JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6
# CUdevice_attribute values
_CC_MAJOR, _CC_MINOR = 75, 76
# CUstreamCaptureMode: only this thread's calls are checked while it captures
_CAPTURE_THREAD_LOCAL = 1


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver or device (the message is ``probe()``'s reason)."""


class Driver:
    """The driver library, every call checked. ``lib`` is a loaded ``libcuda`` (or an
    object with the same functions, for tests)."""

    def __init__(self, lib: object) -> None:
        self.lib = lib

    def error_text(self, code: int) -> str:
        """``NAME (description)`` of a CUresult, from the driver."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return f"unknown CUresult {code}"
        if self.lib.cuGetErrorString(code, ctypes.byref(text)) != 0 or not text.value:
            return name.value.decode()
        return f"{name.value.decode()} ({text.value.decode()})"

    def call(self, function: str, *args: object) -> None:
        """``lib.function(*args)``; raises CudaError unless it returns CUDA_SUCCESS."""
        code = getattr(self.lib, function)(*args)
        if code != 0:
            raise CudaError(f"{function} failed: {self.error_text(code)}", code)


def load(library: str | None = None) -> Driver:
    """The driver, initialised; raises CudaUnavailable with the reason."""
    library = library or LIBRARY
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        raise CudaUnavailable(f"{library} not found (no NVIDIA driver)") from None
    driver = Driver(lib)
    code = lib.cuInit(0)
    if code != 0:
        raise CudaUnavailable(f"cuInit failed: {driver.error_text(code)}")
    return driver


def probe(library: str | None = None) -> str | None:
    """None when a CUDA device is usable here, else why not (one line)."""
    try:
        driver = load(library)
        count = ctypes.c_int()
        driver.call("cuDeviceGetCount", ctypes.byref(count))
    except (CudaUnavailable, CudaError) as e:
        return str(e)
    return None if count.value > 0 else "the NVIDIA driver reports no CUDA device"


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_memory: int  # bytes
    compute_capability: tuple[int, int]

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def devices(driver: Driver) -> list[DeviceInfo]:
    count = ctypes.c_int()
    driver.call("cuDeviceGetCount", ctypes.byref(count))
    return [device_info(driver, i) for i in range(count.value)]


def device_info(driver: Driver, index: int) -> DeviceInfo:
    dev = ctypes.c_int()
    driver.call("cuDeviceGet", ctypes.byref(dev), index)
    name = ctypes.create_string_buffer(256)
    driver.call("cuDeviceGetName", name, len(name), dev)
    total = ctypes.c_size_t()
    driver.call("cuDeviceTotalMem_v2", ctypes.byref(total), dev)
    cc = []
    for attribute in (_CC_MAJOR, _CC_MINOR):
        value = ctypes.c_int()
        driver.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, dev)
        cc.append(value.value)
    return DeviceInfo(index, name.value.decode(errors="replace"), total.value, (cc[0], cc[1]))


@dataclass
class DeviceArray:
    """``nbytes`` of device memory at ``ptr`` (a CUdeviceptr)."""

    ptr: int
    nbytes: int


def _check_range(what: str, array: DeviceArray, offset: int, nbytes: int) -> None:
    if offset < 0 or offset + nbytes > array.nbytes:
        raise ValueError(
            f"{what} device memory: bytes {offset}..{offset + nbytes} of {array.nbytes}"
        )


class Module:
    """A loaded PTX module; ``function(name)`` looks up an entry kernel."""

    def __init__(self, context: Context, handle: ctypes.c_void_p, info_log: str) -> None:
        self.context, self.handle, self.info_log = context, handle, info_log

    def function(self, name: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.context.driver.call(
            "cuModuleGetFunction", ctypes.byref(fn), self.handle, name.encode()
        )
        return fn


class Context:
    """The primary context of device ``index``, current on the calling thread."""

    def __init__(self, driver: Driver, index: int = 0) -> None:
        self.driver = driver
        self.device = device_info(driver, index)
        dev = ctypes.c_int()
        driver.call("cuDeviceGet", ctypes.byref(dev), index)
        self._dev = dev
        self.handle = ctypes.c_void_p()
        driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.handle), dev)
        driver.call("cuCtxSetCurrent", self.handle)

    def close(self) -> None:
        if self.handle:
            self.driver.call("cuDevicePrimaryCtxRelease_v2", self._dev)
            self.handle = ctypes.c_void_p()

    def load_ptx(self, ptx: str, what: str = "PTX module") -> Module:
        """Load PTX text (JIT-compiled by the driver for this device); a rejection raises
        CudaError with the driver's error log."""
        error_log = ctypes.create_string_buffer(_LOG_BYTES)
        info_log = ctypes.create_string_buffer(_LOG_BYTES)
        options = (ctypes.c_int * 4)(
            _JIT_ERROR_LOG_BUFFER,
            _JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            _JIT_INFO_LOG_BUFFER,
            _JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        )
        values = (ctypes.c_void_p * 4)(
            ctypes.cast(error_log, ctypes.c_void_p),
            ctypes.c_void_p(_LOG_BYTES),
            ctypes.cast(info_log, ctypes.c_void_p),
            ctypes.c_void_p(_LOG_BYTES),
        )
        handle = ctypes.c_void_p()
        image = ctypes.create_string_buffer(ptx.encode())
        try:
            self.driver.call("cuModuleLoadDataEx", ctypes.byref(handle), image, 4, options, values)
        except CudaError as e:
            log = error_log.value.decode(errors="replace").strip() or "(empty)"
            raise CudaError(f"{what}: {e} -- driver log: {log}", e.code) from None
        return Module(self, handle, info_log.value.decode(errors="replace").strip())

    def alloc(self, nbytes: int) -> DeviceArray:
        ptr = ctypes.c_uint64()
        self.driver.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)))
        return DeviceArray(ptr.value, nbytes)

    def free(self, array: DeviceArray) -> None:
        self.driver.call("cuMemFree_v2", ctypes.c_uint64(array.ptr))

    def to_device(self, host: np.ndarray) -> DeviceArray:
        host = np.ascontiguousarray(host)
        array = self.alloc(host.nbytes)
        self.copy_in(array, host)
        return array

    def copy_in(self, array: DeviceArray, host: np.ndarray, offset: int = 0) -> None:
        """``host``'s bytes into ``array`` from byte ``offset`` on."""
        host = np.ascontiguousarray(host)
        _check_range("copy into", array, offset, host.nbytes)
        self.driver.call(
            "cuMemcpyHtoD_v2",
            ctypes.c_uint64(array.ptr + offset),
            host.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_size_t(host.nbytes),
        )

    def copy_out(self, array: DeviceArray, host: np.ndarray, offset: int = 0) -> np.ndarray:
        """``host.nbytes`` bytes of ``array`` from byte ``offset`` on into ``host``; waits
        for the work queued before it."""
        if not host.flags.c_contiguous:
            raise ValueError("copy_out needs a contiguous host array")
        _check_range("copy out of", array, offset, host.nbytes)
        self.driver.call(
            "cuMemcpyDtoH_v2",
            host.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_uint64(array.ptr + offset),
            ctypes.c_size_t(host.nbytes),
        )
        return host

    def copy_within(
        self, dst: DeviceArray, dst_offset: int, src: DeviceArray, src_offset: int, nbytes: int
    ) -> None:
        """Device to device, queued after the work before it."""
        _check_range("copy into", dst, dst_offset, nbytes)
        _check_range("copy out of", src, src_offset, nbytes)
        self.driver.call(
            "cuMemcpyDtoD_v2",
            ctypes.c_uint64(dst.ptr + dst_offset),
            ctypes.c_uint64(src.ptr + src_offset),
            ctypes.c_size_t(nbytes),
        )

    def zero(self, array: DeviceArray) -> None:
        size = ctypes.c_size_t(array.nbytes)
        self.driver.call("cuMemsetD8_v2", ctypes.c_uint64(array.ptr), 0, size)

    def stream(self, owner: object) -> ctypes.c_void_p:
        """A new stream (blocking: ordered with the default stream's copies), destroyed
        when ``owner`` is garbage."""
        handle = ctypes.c_void_p()
        self.driver.call("cuStreamCreate", ctypes.byref(handle), 0)
        destroy = ctypes.c_void_p(handle.value)
        finalize = weakref.finalize(owner, self.driver.call, "cuStreamDestroy_v2", destroy)
        finalize.atexit = False  # the driver may be gone at exit
        return handle

    def capture(self, stream: ctypes.c_void_p, record: Callable[[], None]) -> Graph:
        """The launches ``record()`` queues on ``stream`` as an instantiated CUDA graph
        (nothing runs while capturing; their parameters are captured by value, so what
        changes from one replay to the next must be in device memory they point to)."""
        self.driver.call("cuStreamBeginCapture_v2", stream, _CAPTURE_THREAD_LOCAL)
        graph = ctypes.c_void_p()
        try:
            record()
        except BaseException:
            # end the capture all the same (or the stream stays capturing); a capture a
            # failed call invalidated ends with an error and no graph, which is expected
            code = self.driver.lib.cuStreamEndCapture(stream, ctypes.byref(graph))
            if code == 0 and graph.value:
                self.driver.call("cuGraphDestroy", graph)
            raise
        self.driver.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        try:
            executable = ctypes.c_void_p()
            self.driver.call(
                "cuGraphInstantiateWithFlags", ctypes.byref(executable), graph, ctypes.c_uint64(0)
            )
        except CudaError:
            self.driver.call("cuGraphDestroy", graph)
            raise
        return Graph(self.driver, graph, executable)

    def launch(
        self,
        function: ctypes.c_void_p,
        grid: tuple[int, int],
        params: Sequence[int],
        shared_bytes: int = 0,
        stream: ctypes.c_void_p | None = None,
    ) -> None:
        """Launch ``function`` on ``grid`` = (blocks, threads per block) along x with
        64-bit parameters ``params`` (device pointers and integers), on ``stream`` (the
        default stream when None)."""
        words = [ctypes.c_uint64(p) for p in params]
        pointers = (ctypes.c_void_p * len(words))(
            *(ctypes.cast(ctypes.byref(w), ctypes.c_void_p) for w in words)
        )
        blocks, threads = grid
        self.driver.call(
            "cuLaunchKernel",
            function,
            blocks, 1, 1,
            threads, 1, 1,
            shared_bytes,
            stream,
            pointers,
            None,
        )  # fmt: skip

    def synchronize(self) -> None:
        self.driver.call("cuCtxSynchronize")


class Graph:
    """An instantiated CUDA graph: ``launch(stream)`` replays its captured launches with one
    driver call. Its executable and graph are destroyed when it is no longer referenced."""

    def __init__(self, driver: Driver, graph: ctypes.c_void_p, executable: ctypes.c_void_p) -> None:
        self.driver, self.executable = driver, executable
        finalize = weakref.finalize(self, _destroy_graph, driver, graph.value, executable.value)
        finalize.atexit = False  # the driver may be gone at exit

    def launch(self, stream: ctypes.c_void_p) -> None:
        self.driver.call("cuGraphLaunch", self.executable, stream)


def _destroy_graph(driver: Driver, graph: int, executable: int) -> None:
    driver.call("cuGraphExecDestroy", ctypes.c_void_p(executable))
    driver.call("cuGraphDestroy", ctypes.c_void_p(graph))
