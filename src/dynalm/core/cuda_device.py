"""The CUDA device (preview): the NVPTX lowering of the CPU's kernel programs
(``kernel.nvptx``), loaded and launched through the CUDA driver API (``core.cuda_driver``).

Memory. The weights (repacked into the 8-lane kernels' layouts), the KV pages
(``CudaKVStorage``) and the step's activations live in device memory. The executor plans its
buffers as host arrays; here each is a *mirror*: a host array with a device copy of the same
size (``CudaDevice.mirror``). Binding an op (``ir.lower.cuda``) writes the device addresses
of its operands into the kernel's argument block (``CudaDevice.address`` maps a view of a
mirror to the same bytes of its copy), so kernels only ever see device memory. The host side
is where the executor writes a step's inputs and reads its logits. Norm weights and rope
tables are mirrors too, uploaded once.

Every op of the op table has a kernel (the CPU's element-wise programs: the same definition
on both devices); what the device cannot take is a matmul weight without a JIT kernel of its
format (``supports`` says so before a model loads, and ``--backend auto`` picks the CPU).
A step is device work only between the upload of its inputs and the download of its logits
(the embedding table is a dense fp32 copy, its rows gathered by a kernel), captured once per
step shape as a CUDA graph (``ir.lower.cuda``; a prefill longer than the executor keeps is
launched kernel by kernel). Not in the preview: ``--mode safe`` is the CPU's oracle; the
repack cache; attention stores the step's keys on one GPU thread per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from dynalm.core import cuda_driver, elementwise, quant
from dynalm.core.cpu_device import CpuDevice, physical_cores
from dynalm.core.cuda_driver import DeviceArray
from dynalm.core.device import MODES, Device, MatmulKernel
from dynalm.core.kv_storage import PAGE_ARRAYS, KVGeometry
from dynalm.core.matmul import QuantMatmul
from dynalm.errors import DeviceUnavailable, InvalidRequest
from dynalm.kernel import attention_program, nvptx
from dynalm.kernel.backends import Program, Spec
from dynalm.kernel.matmul_programs import MatmulKernels

MIN_COMPUTE_CAPABILITY = (8, 0)  # the PTX targets sm_80 (kernel.nvptx.SM)


@dataclass(frozen=True)
class CudaMatmul:
    """A matmul weight in device memory: the kernels of its format and mode, the repacked
    weights, ``[n_rows, n_cols]``."""

    kernels: MatmulKernels
    weights: DeviceArray
    n_rows: int
    n_cols: int


class CudaDevice(Device):
    """One CUDA device (``index``) through ``driver`` (default: ``libcuda``)."""

    name = "cuda"

    def __init__(
        self,
        mode: str = "auto",
        threads: int | None = None,
        driver: cuda_driver.Driver | None = None,
        index: int = 0,
        graphs: bool = True,
    ) -> None:
        if mode not in MODES:
            raise InvalidRequest(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
        if mode == "safe":
            raise InvalidRequest("--mode safe is the CPU's fp32 numpy reference: run it with --cpu")
        try:
            self.context = cuda_driver.Context(driver or cuda_driver.load(), index)
        except (cuda_driver.CudaUnavailable, cuda_driver.CudaError) as e:
            raise DeviceUnavailable(f"CUDA: {e}") from None
        info = self.context.device
        if info.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise DeviceUnavailable(
                f"CUDA device {index} ({info.name}) is {info.sm}; the preview's PTX needs "
                f"sm_{''.join(map(str, MIN_COMPUTE_CAPABILITY))} or later"
            )
        self.mode = mode
        self.graphs = graphs  # a step is one captured CUDA graph (else its launches one by one)
        # per step shape (tokens, logit rows) bound: (driver launch calls a step of that
        # shape makes, kernels it runs); ``dynalm bench --gpu`` and gpu_check report it
        self.submitted: dict[tuple[int, int], tuple[int, int]] = {}
        self.threads = threads or physical_cores()  # host threads (repacking weights)
        self.backend = nvptx.NVPTX
        # the host's view of the same kernels: which matmul a weight gets and its bytes
        self._host = CpuDevice(mode, 1)
        self._mirrors: dict[int, tuple[int, DeviceArray]] = {}  # host address -> (bytes, copy)
        self._modules: dict[tuple, cuda_driver.Module] = {}
        self._functions: dict[tuple, tuple[object, nvptx.Entry]] = {}
        self.allocated = 0  # bytes of device memory held

    def describe(self) -> str:
        info = self.context.device
        return (
            f"cuda:{info.index} {info.name} ({info.sm}, {info.total_memory >> 20} MiB; "
            f"mode {self.mode}, kernels {self.backend.name} PTX; preview)"
        )

    # -- memory ----------------------------------------------------------------------
    def alloc(self, nbytes: int, owner: object | None = None) -> DeviceArray:
        """``nbytes`` of device memory, zeroed; freed with ``owner`` when given."""
        array = self.context.alloc(nbytes)
        self.context.zero(array)
        self.allocated += array.nbytes
        if owner is not None:
            self.free_with(owner, array)
        return array

    def free_with(self, owner: object, array: DeviceArray) -> None:
        """Free ``array`` when ``owner`` is garbage (not at exit: the driver may be gone)."""
        weakref.finalize(owner, self.free, array).atexit = False

    def free(self, array: DeviceArray) -> None:
        self.context.free(array)
        self.allocated -= array.nbytes

    def mirror(self, host: np.ndarray) -> np.ndarray:
        """``host`` (C-contiguous) with a device copy of its bytes, made now; the copy is
        freed with ``host`` (so the device's own mirrors are arrays owning their data)."""
        base = host.__array_interface__["data"][0]
        if base not in self._mirrors:
            if not host.flags.c_contiguous:
                raise ValueError("a mirrored array must be C-contiguous")
            copy = self.alloc(host.nbytes)
            self.context.copy_in(copy, host)
            self._mirrors[base] = (host.nbytes, copy)
            weakref.finalize(host, self._unmirror, base).atexit = False
        return host

    def _unmirror(self, base: int) -> None:
        self.free(self._mirrors.pop(base)[1])

    def mirrored(self, at: int) -> tuple[DeviceArray, int] | None:
        """The device copy of the mirror holding host address ``at``, and ``at``'s offset."""
        for base, (nbytes, copy) in self._mirrors.items():
            if base <= at < base + max(nbytes, 1):
                return copy, at - base
        return None

    def device_view(self, view: np.ndarray) -> tuple[DeviceArray, int]:
        """The device copy of the mirror ``view`` lies in, and the view's byte offset in it."""
        found = self.mirrored(view.__array_interface__["data"][0])
        if found is None:
            raise ValueError(f"a {view.dtype} {list(view.shape)} array has no device copy")
        return found

    def address(self, view: np.ndarray) -> int:
        copy, offset = self.device_view(view)
        return copy.ptr + offset

    # -- what it runs and holds ---------------------------------------------------
    def supports(
        self,
        op: str,
        weights: tuple[tuple[int, tuple[int, ...]], ...],
        attrs: Mapping[str, object] = MappingProxyType({}),
    ) -> bool:
        """Whether this device's kernel for ``op`` takes these weights and attributes: a
        matmul needs a JIT kernel of its format (rows of whole 32-value blocks; a bias is any
        vector), attention heads of whole 8-lane vectors (the CPU has a numpy fallback for
        the others, the GPU none). (The ops it has kernels for at all are its binder's
        table, ``ir.lower.cuda``.)"""
        if op in ("matmul", "matmul_add"):
            ggml_type, shape = weights[0]
            return self.matmul_kernel(ggml_type, shape).kind.startswith("jit-")  # type: ignore[arg-type]
        if op in ("moe_route", "expert_matmul", "moe_combine"):
            return False  # routes are data-dependent rows: no GPU kernels yet (auto: the CPU)
        if op == "attention":
            return attention_program.supported(int(attrs["head_dim"]), "f32")  # type: ignore[call-overload]
        return True

    def matmul_kernel(self, ggml_type: int, shape: tuple[int, int]) -> MatmulKernel:
        return self._host.matmul_kernel(ggml_type, shape)

    def prepared_bytes(self, ggml_type: int, shape: tuple[int, ...], use: str) -> int:
        if use == "embedding":  # the dense fp32 table (``embedding``)
            return 4 * int(np.prod(shape))
        return self._host.prepared_bytes(ggml_type, shape, use)

    # -- weights -------------------------------------------------------------------
    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        dense = quant.dequantize(raw, ggml_type, shape[-1]).reshape(shape)
        return self.mirror(np.array(dense, np.float32))  # an array of its own

    def embedding(
        self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], **how: object
    ) -> np.ndarray:
        """The table dequantised to fp32 once, in device memory: the step looks its rows up
        with the row-gather kernel (``elementwise.rows``), so no host work lies between the
        upload of the token ids and the download of the logits. (The same values as the
        CPU's per-step dequantisation: it is row by row.)"""
        return self.vector(raw, ggml_type, shape)

    def matmul(
        self,
        raw: np.ndarray | Callable[[], np.ndarray],
        ggml_type: int,
        shape: tuple[int, int],
        *,
        release_rows: Callable[[int, int], None] | None = None,
        **_: object,
    ) -> CudaMatmul:
        n_rows, n_cols = shape
        kernel = self.matmul_kernel(ggml_type, shape).kind
        if not kernel.startswith("jit-"):
            raise InvalidRequest(
                f"the CUDA preview has no matmul kernel for {quant.ggml_type_name(ggml_type)} "
                f"weights [{n_rows}, {n_cols}]; run this model with --cpu"
            )
        rows = raw() if callable(raw) else raw
        kernels = MatmulKernels(ggml_type, kernel.removeprefix("jit-"), self.backend, n_cols)
        packed = QuantMatmul.checked_repack(
            ggml_type, rows, n_cols, n_rows, kernels.layout, release_rows
        )
        prepared = CudaMatmul(kernels, self.alloc(packed.nbytes), n_rows, n_cols)
        self.free_with(prepared, prepared.weights)
        self.context.copy_in(prepared.weights, packed)
        return prepared

    def holds_copy(self, prepared: object) -> bool:
        return isinstance(prepared, CudaMatmul)

    def buffer(self, rows: int, width: int, dtype: type = np.float32) -> np.ndarray:
        return self.mirror(np.zeros((rows, width), dtype))

    def kv_storage(self, geometry: KVGeometry) -> CudaKVStorage:
        return CudaKVStorage(self, geometry)

    # -- kernels -------------------------------------------------------------------
    def self_check(self) -> None:
        """Load and run one kernel (RMSNorm of 4 rows) and compare it with the CPU's numpy
        reference: a driver that rejects the PTX, or a device that computes wrongly, is
        found before a model is loaded (``--backend auto`` then falls back to the CPU)."""
        from dynalm.core.cpu_ops import rms_norm

        rng = np.random.default_rng(0)
        x, w = (self.mirror(rng.standard_normal(n).astype(np.float32)) for n in ((4, 64), 64))
        out, block = self.buffer(4, 64), self.alloc(8 * elementwise.MAX_WORDS, owner=x)
        bound = elementwise.rms_norm(out, x, w, 1e-5, backend=self.backend)
        _, program, spec = bound.request
        words = [4, *(self.address(a) for a in bound.arrays)]
        try:
            self.context.copy_in(block, np.array(words, np.int64))
            fn, entry = self.function(program, spec, "rms_norm")
            self.context.launch(fn, entry.grid(4), (block.ptr, 4))
            copy, offset = self.device_view(out)
            self.context.copy_out(copy, out, offset)
        except cuda_driver.CudaError as e:
            raise DeviceUnavailable(f"CUDA self-check: {e}") from None
        want = np.empty_like(out)
        rms_norm(want, x, w, 1e-5)
        if not np.allclose(out, want, rtol=1e-4, atol=1e-5):  # 64-term sums: ~1e-6
            worst = float(np.abs(out - want).max())
            raise DeviceUnavailable(f"CUDA self-check: RMSNorm off by {worst:.3g} on the device")

    def function(self, program: Program, spec: Spec, entry: str) -> tuple[object, nvptx.Entry]:
        """A kernel's entry, its PTX lowered and loaded once."""
        key = (program.name, tuple(sorted(spec.items())))
        if (key, entry) not in self._functions:
            lowered = self.backend.lower(program, spec)
            if key not in self._modules:
                what = f"{program.name} kernel {dict(spec)}"
                self._modules[key] = self.context.load_ptx(lowered.ptx, what)
            where = lowered.entries[entry]
            self._functions[key, entry] = (self._modules[key].function(where.name), where)
        return self._functions[key, entry]


class CudaKVStorage:
    """The KV pages' bytes in device memory: ``KVGeometry``'s arrays, one allocation per
    layer and array (``k``, ``v``, q8_0's ``k_scale``/``v_scale`` and recent buffers)."""

    def __init__(self, device: CudaDevice, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.page_size, self.dtype = geometry.page_size, geometry.dtype
        self.recent = geometry.recent
        self._context = device.context
        self._row_bytes: dict[str, int] = {}
        self.nbytes = self.page_nbytes = 0
        for name, (layers, shape, dtype) in geometry.arrays().items():
            row_bytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
            arrays = [device.alloc(shape[0] * row_bytes, owner=self) for _ in range(layers)]
            setattr(self, name, arrays)
            self._row_bytes[name] = row_bytes
            self.nbytes += layers * shape[0] * row_bytes
            self.page_nbytes += layers * shape[0] * row_bytes if name in PAGE_ARRAYS else 0

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: page ``dst`` gets ``src``'s keys and values in every layer."""
        for name in PAGE_ARRAYS:
            n = self._row_bytes[name] * self.page_size
            for array in getattr(self, name):
                self._context.copy_within(array, dst * n, array, src * n, n)

    def save_recent(self, rows: np.ndarray) -> list[np.ndarray]:
        """Host copies of recent-buffer ``rows`` ``[layers, 2, len(rows), ...]``."""
        inner, n = self.geometry.recent_shape[1:], self._row_bytes["k_recent"]
        saved = []
        for pair in zip(self.k_recent, self.v_recent, strict=True):
            out = np.empty((2, len(rows), *inner), np.float16)
            for which, array in enumerate(pair):
                for i, row in enumerate(rows):
                    self._context.copy_out(array, out[which, i], int(row) * n)
            saved.append(out)
        return saved

    def restore_recent(self, rows: np.ndarray, saved: list[np.ndarray]) -> None:
        n = self._row_bytes["k_recent"]
        for pair, old in zip(zip(self.k_recent, self.v_recent, strict=True), saved, strict=True):
            for which, array in enumerate(pair):
                for i, row in enumerate(rows):
                    self._context.copy_in(array, old[which, i], int(row) * n)
