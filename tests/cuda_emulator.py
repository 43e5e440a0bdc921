"""A CUDA driver that runs on this CPU: what lets CI run the CUDA device end to end.

``EmulatedLibcuda`` answers the driver API calls ``core.cuda_driver`` makes, with libcuda's
signatures and CUresult codes. Device memory is host memory it allocates and checks: every
copy and memset must lie inside one live allocation, and every launch's argument block must
be device memory whose pointer-sized words (values from 2**32 to 2**47, where x86-64 Linux
maps memory; counts, strides and f64 bit patterns fall outside) point into device memory -- a
host address reaching a kernel would crash a real GPU, so it fails here. A loaded PTX module
is recognised as one the NVPTX backend lowered in this process, and its entries run as the
backend's host twin (``nvptx.host_twin``: the same programs at the same width and integer
sums, every thread of the launch's grid in turn). Streams capture launches into CUDA graphs
(recorded in order with their parameters by value, replayed by ``cuGraphLaunch``, each
replayed launch checked as a direct one is); a synchronous copy, or a default-stream launch,
while a stream captures fails as CUDA's would. What it cannot show: the GPU's own
arithmetic (the float order of reductions) and timing.
"""

from __future__ import annotations

import ctypes

import numpy as np

from dynalm.kernel import nvptx

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, INVALID_PTX, NOT_FOUND, ILLEGAL_ADDRESS = (
    0, 1, 2, 218, 500, 700
)  # fmt: skip
CAPTURE_UNSUPPORTED = 900  # a call a capturing thread may not make (a synchronous copy)
ERRORS = {
    CAPTURE_UNSUPPORTED: (
        b"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        b"operation not permitted when stream is capturing",
    ),
    INVALID_VALUE: (b"CUDA_ERROR_INVALID_VALUE", b"invalid argument"),
    OUT_OF_MEMORY: (b"CUDA_ERROR_OUT_OF_MEMORY", b"out of memory"),
    INVALID_PTX: (b"CUDA_ERROR_INVALID_PTX", b"a PTX JIT compilation failed"),
    NOT_FOUND: (b"CUDA_ERROR_NOT_FOUND", b"named symbol not found"),
    ILLEGAL_ADDRESS: (b"CUDA_ERROR_ILLEGAL_ADDRESS", b"an illegal memory access was encountered"),
}
_ARG_WORDS = 17  # the longest argument block a launch reads (attention's)


class EmulatedLibcuda:
    def __init__(
        self,
        memory: int = 8 << 30,
        compute_capability: tuple[int, int] = (8, 0),
        name: bytes = b"DynaLM emulated GPU",
    ) -> None:
        self.memory, self.cc, self.name = memory, compute_capability, name
        self.allocations: dict[int, np.ndarray] = {}  # address -> its bytes
        self.modules: dict[int, tuple[str, dict]] = {}
        self.functions: dict[int, nvptx.HostEntry] = {}
        self.launches = 0  # kernels run (one by one or replayed from a graph)
        self.graph_launches = 0
        self.warp_launches = 0  # of ``launches``: warp-cooperative kernels (the mma tiles)
        self.streams: dict[int, list | None] = {}  # stream -> its capture's launches, or None
        self.graphs: dict[int, list] = {}  # graph (and executable) -> its launches
        self.executables: dict[int, list] = {}
        self.error: str | None = None  # why the last failing call failed

    # -- errors and devices --------------------------------------------------------------
    def cuGetErrorName(self, code: int, out: object) -> int:  # noqa: N802 (the C names)
        if code not in ERRORS:
            return INVALID_VALUE
        out._obj.value = ERRORS[code][0]
        return SUCCESS

    def cuGetErrorString(self, code: int, out: object) -> int:  # noqa: N802
        out._obj.value = ERRORS[code][1]
        return SUCCESS

    def cuInit(self, flags: int) -> int:  # noqa: N802
        return SUCCESS

    def cuDeviceGetCount(self, count: object) -> int:  # noqa: N802
        count._obj.value = 1
        return SUCCESS

    def cuDeviceGet(self, device: object, index: int) -> int:  # noqa: N802
        device._obj.value = index
        return SUCCESS if index == 0 else INVALID_VALUE

    def cuDeviceGetName(self, buffer: ctypes.Array, size: int, device: object) -> int:  # noqa: N802
        buffer.value = self.name[: size - 1]
        return SUCCESS

    def cuDeviceTotalMem_v2(self, total: object, device: object) -> int:  # noqa: N802
        total._obj.value = self.memory
        return SUCCESS

    def cuDeviceGetAttribute(self, value: object, attribute: int, device: object) -> int:  # noqa: N802
        value._obj.value = {75: self.cc[0], 76: self.cc[1]}[attribute]
        return SUCCESS

    def cuDevicePrimaryCtxRetain(self, context: object, device: object) -> int:  # noqa: N802
        context._obj.value = 1
        return SUCCESS

    def cuCtxSetCurrent(self, context: object) -> int:  # noqa: N802
        return SUCCESS

    def cuDevicePrimaryCtxRelease_v2(self, device: object) -> int:  # noqa: N802
        return SUCCESS

    def cuCtxSynchronize(self) -> int:  # noqa: N802
        return SUCCESS  # launches ran when they were made

    # -- memory --------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return sum(a.nbytes for a in self.allocations.values())

    def _fail(self, code: int, why: str) -> int:
        self.error = why
        return code

    def _inside(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies in one allocation."""
        for base, array in self.allocations.items():
            if base <= address and address + nbytes <= base + array.nbytes:
                return True
        return False

    def cuMemAlloc_v2(self, pointer: object, nbytes: ctypes.c_size_t) -> int:  # noqa: N802
        if self.allocated + nbytes.value > self.memory:
            return self._fail(OUT_OF_MEMORY, f"{nbytes.value} bytes more than the device has")
        array = np.empty(nbytes.value, np.uint8)
        self.allocations[array.ctypes.data] = array
        pointer._obj.value = array.ctypes.data
        return SUCCESS

    def cuMemFree_v2(self, pointer: ctypes.c_uint64) -> int:  # noqa: N802
        if self.allocations.pop(pointer.value, None) is None:
            return self._fail(INVALID_VALUE, f"free of {pointer.value:#x}: not an allocation")
        return SUCCESS

    def _copy(self, dst: int, src: int, nbytes: int, device: tuple[int, ...]) -> int:
        if self._capturing():
            return self._fail(CAPTURE_UNSUPPORTED, "a synchronous copy while a stream captures")
        for address in device:
            if not self._inside(address, nbytes):
                why = f"{nbytes} bytes at {address:#x} are not device memory"
                return self._fail(ILLEGAL_ADDRESS, why)
        ctypes.memmove(dst, src, nbytes)
        return SUCCESS

    def cuMemcpyHtoD_v2(self, dst: ctypes.c_uint64, src: ctypes.c_void_p, n: object) -> int:  # noqa: N802
        return self._copy(dst.value, src.value, n.value, (dst.value,))

    def cuMemcpyDtoH_v2(self, dst: ctypes.c_void_p, src: ctypes.c_uint64, n: object) -> int:  # noqa: N802
        return self._copy(dst.value, src.value, n.value, (src.value,))

    def cuMemcpyDtoD_v2(self, dst: ctypes.c_uint64, src: ctypes.c_uint64, n: object) -> int:  # noqa: N802
        return self._copy(dst.value, src.value, n.value, (dst.value, src.value))

    def cuMemsetD8_v2(self, dst: ctypes.c_uint64, value: int, n: object) -> int:  # noqa: N802
        if not self._inside(dst.value, n.value):
            return self._fail(ILLEGAL_ADDRESS, f"memset of {n.value} bytes at {dst.value:#x}")
        ctypes.memset(dst.value, value, n.value)
        return SUCCESS

    # -- modules and launches ------------------------------------------------------------
    def cuModuleLoadDataEx(self, handle, image, n, options, values) -> int:  # noqa: N802, ANN001
        source = nvptx.NVPTX.source_of(image.value.decode())
        if source is None:
            log = b"emulator: this PTX was not lowered by DynaLM's NVPTX backend in this process"
            at = [options[i] for i in range(n)].index(5)  # CU_JIT_ERROR_LOG_BUFFER
            ctypes.memmove(values[at], log, len(log) + 1)
            return INVALID_PTX
        handle._obj.value = len(self.modules) + 1
        self.modules[handle._obj.value] = source
        return SUCCESS

    def cuModuleGetFunction(self, function: object, module: ctypes.c_void_p, name: bytes) -> int:  # noqa: N802
        program_name, spec = self.modules[module.value]
        program = {p.name: p for p, _ in nvptx.device_kernels()}[program_name]
        lowered = nvptx.NVPTX.lower(program, spec)
        short = [s for s, e in lowered.entries.items() if e.name == name.decode()]
        if not short:
            return NOT_FOUND
        function._obj.value = len(self.functions) + 1
        self.functions[function._obj.value] = nvptx.host_twin(program, spec)[short[0]]
        return SUCCESS

    def cuLaunchKernel(  # noqa: N802
        self,
        function,
        gx,
        gy,
        gz,
        bx,
        by,
        bz,
        shared,
        stream,
        params,
        extra,  # noqa: ANN001
    ) -> int:
        if (gy, gz, by, bz) != (1, 1, 1, 1):
            return self._fail(INVALID_VALUE, "the kernels launch along x only")
        # the parameters are read now, by value (a capture keeps them, as CUDA's does)
        args, rows = (ctypes.c_uint64.from_address(params[i]).value for i in range(2))
        launch = (function.value, gx, bx, args, rows)
        stream = _handle(stream)
        if stream:
            if stream not in self.streams:
                return self._fail(INVALID_VALUE, f"launch on {stream}: not a stream")
            if self.streams[stream] is not None:
                self.streams[stream].append(launch)  # type: ignore[union-attr]
                return SUCCESS
        elif self._capturing():
            return self._fail(CAPTURE_UNSUPPORTED, "a launch on the default stream while capturing")
        return self._run(*launch)

    def _run(self, function: int, gx: int, bx: int, args: int, rows: int) -> int:
        if not self._inside(args, 8):
            return self._fail(ILLEGAL_ADDRESS, f"argument block at {args:#x} is not device memory")
        for i in range(_ARG_WORDS):
            if not self._inside(args + 8 * i, 8):
                break  # the end of the block's allocation
            word = ctypes.c_uint64.from_address(args + 8 * i).value
            if 1 << 32 <= word < 1 << 47 and not self._inside(word, 1):
                why = f"argument word {i} ({word:#x}) points outside device memory"
                return self._fail(ILLEGAL_ADDRESS, why)
        entry = self.functions[function]
        width = entry.entry.width  # a warp-cooperative kernel: blocks of whole warps
        if bx % width:
            why = f"{entry.entry.name}: blocks of {bx} threads, not whole warps of {width}"
            return self._fail(INVALID_VALUE, why)
        entry.launch(args, rows, (gx, bx))
        self.launches += 1
        self.warp_launches += width > 1
        return SUCCESS

    # -- streams and graphs: a capture records a stream's launches in order, an
    # instantiated graph replays them (each checked as it runs, as a launch is) --------
    def _capturing(self) -> bool:
        return any(launches is not None for launches in self.streams.values())

    def cuStreamCreate(self, stream: object, flags: int) -> int:  # noqa: N802
        stream._obj.value = 0x5000 + len(self.streams) + 1  # never a device address
        self.streams[stream._obj.value] = None
        return SUCCESS

    def cuStreamDestroy_v2(self, stream: object) -> int:  # noqa: N802
        stream = _handle(stream)
        if stream not in self.streams or self.streams[stream] is not None:
            return self._fail(INVALID_VALUE, "destroy of a stream that is not one, or captures")
        del self.streams[stream]
        return SUCCESS

    def cuStreamSynchronize(self, stream: object) -> int:  # noqa: N802
        return SUCCESS  # launches ran when they were made

    def cuStreamBeginCapture_v2(self, stream: object, mode: int) -> int:  # noqa: N802
        stream = _handle(stream)
        if self.streams.get(stream, 0) is not None:  # the default stream cannot capture
            return self._fail(INVALID_VALUE, f"capture on {stream}: not an idle stream")
        self.streams[stream] = []
        return SUCCESS

    def cuStreamEndCapture(self, stream: object, graph: object) -> int:  # noqa: N802
        launches = self.streams.get(_handle(stream))
        if launches is None:
            return self._fail(INVALID_VALUE, "end of a capture that did not begin")
        self.streams[_handle(stream)] = None
        graph._obj.value = 0x6000 + len(self.graphs) + 1
        self.graphs[graph._obj.value] = launches
        return SUCCESS

    def cuGraphInstantiateWithFlags(self, executable: object, graph: object, flags: object) -> int:  # noqa: N802
        launches = self.graphs.get(_handle(graph))
        if launches is None:
            return self._fail(INVALID_VALUE, "instantiate of a graph that is not one")
        executable._obj.value = 0x7000 + len(self.executables) + 1
        self.executables[executable._obj.value] = list(launches)
        return SUCCESS

    def cuGraphLaunch(self, executable: object, stream: object) -> int:  # noqa: N802
        launches = self.executables.get(_handle(executable))
        if launches is None:
            return self._fail(INVALID_VALUE, "launch of a graph that is not instantiated")
        self.graph_launches += 1
        for launch in launches:
            code = self._run(*launch)
            if code != SUCCESS:
                return code
        return SUCCESS

    def cuGraphExecDestroy(self, executable: object) -> int:  # noqa: N802
        found = self.executables.pop(_handle(executable), None) is not None
        return SUCCESS if found else self._fail(INVALID_VALUE, "destroy of no executable")

    def cuGraphDestroy(self, graph: object) -> int:  # noqa: N802
        found = self.graphs.pop(_handle(graph), None) is not None
        return SUCCESS if found else self._fail(INVALID_VALUE, "destroy of no graph")


def _handle(value: object) -> int:
    """A handle passed as a ctypes value, an int or None (0)."""
    return getattr(value, "value", value) or 0
