"""The CUDA device (preview): DynaIR graphs run as the NVPTX lowering of the CPU's kernel
programs (``kernel.nvptx``), loaded and launched through the CUDA driver API
(``core.cuda_driver``).

Memory. The weights (repacked into the 8-lane kernels' layouts), the KV pages
(``CudaKVStorage``) and the step's activations live in device memory. The executor plans its
buffers as host arrays; here each is a *mirror*: a host array with a device copy of the same
size (``CudaDevice.mirror``). Binding an op writes the device addresses of its operands into
the kernel's argument block (``CudaDevice.address`` maps a view of a mirror to the same
bytes of its copy), so kernels only ever see device memory. The host side is where the
executor writes a step's inputs (positions are uploaded by ``begin_step``, the embedding rows
are looked up on the host and copied in) and reads its logits (copied back at the end of
the step). Norm weights and rope tables are mirrors too, uploaded once.

Binding. The programs are the CPU's, at 8 lanes: the element-wise kernels are bound with
``core.elementwise``'s binders (their checks and specialisation), then their arrays'
addresses replaced by the device copies'; matmul and attention blocks are written here from
the programs' argument layouts (``kernel.matmul.A_*``, ``kernel.attention.A_*``). The blocks
are rows of one table in device memory, uploaded when a step shape or the KV storage changes.

A step is one submission: its launches in graph order on the default stream, each over the
grid ``nvptx.Entry.grid`` gives its rows, then the logits copied back (which waits for them).

Not in the preview: ops without a kernel (``mul``, ``scale``, ``silu``, ``gelu_tanh``,
``gather_cols``, copied splits) and matmul biases refuse with their name; ``--mode safe`` is
the CPU's oracle; the repack cache; a launch is a driver call from Python (no CUDA graphs);
attention stores the step's keys on one GPU thread per layer.
"""

from __future__ import annotations

import functools
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from dynalm.core import cuda_driver, elementwise, quant
from dynalm.core.attention import check_layout, row_stride
from dynalm.core.cuda_driver import DeviceArray
from dynalm.core.device import MODES, Call, CpuDevice, Device, Lowering, physical_cores
from dynalm.core.kv_storage import PAGE_ARRAYS, KVGeometry
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch, QuantMatmul
from dynalm.errors import DeviceUnavailable, InvalidRequest
from dynalm.ir.ops import GATES
from dynalm.kernel import attention as attention_program
from dynalm.kernel import layouts, nvptx
from dynalm.kernel.backends import Program, Spec
from dynalm.kernel.formats import QK, UNPACKS
from dynalm.kernel.matmul import (
    A_LDY,
    A_NB,
    A_T,
    A_W,
    A_X,
    A_XD,
    A_XK,
    A_XS,
    A_Y,
    MATMUL,
    MatmulKernels,  # noqa: I001 - grouped by meaning
)
from dynalm.kernel.matmul import N_ARGS as MATMUL_ARGS

if TYPE_CHECKING:
    from dynalm.core.kv_storage import AttentionBatch
    from dynalm.ir.executor import Executor
    from dynalm.ir.graph import Node

MIN_COMPUTE_CAPABILITY = (8, 0)  # the PTX targets sm_80 (kernel.nvptx.SM)
WORDS = max(MATMUL_ARGS, attention_program.N_ARGS, elementwise.MAX_WORDS)  # per block
# One launch of a step: (program, spec, entry, argument block's device address, rows).
Launch = tuple[Program, Spec, str, int, int]


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
        self.threads = threads or physical_cores()  # host threads (repacking weights)
        self.backend = nvptx.NVPTX
        self._host = CpuDevice("exact", 1)  # looks up embedding rows on the host
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

    # -- weights -------------------------------------------------------------------
    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        dense = quant.dequantize(raw, ggml_type, shape[-1]).reshape(shape)
        return self.mirror(np.array(dense, np.float32))  # an array of its own

    def embedding(
        self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], **how: object
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        return self._host.embedding(raw, ggml_type, shape, **how)  # type: ignore[arg-type]

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
        kernel = CpuDevice.matmul_kernel_for(self.mode, ggml_type)
        if not kernel.startswith("jit-") or n_cols % QK:
            raise InvalidRequest(
                f"the CUDA preview has no matmul kernel for {quant.ggml_type_name(ggml_type)} "
                f"weights [{n_rows}, {n_cols}]; run this model with --cpu"
            )
        rows = raw() if callable(raw) else raw
        u = UNPACKS[ggml_type]
        QuantMatmul.check_rows(u, rows, n_cols, n_rows)
        kernels = MatmulKernels(ggml_type, kernel.removeprefix("jit-"), self.backend, n_cols)
        packed = layouts.repack(u, rows, n_cols, kernels.layout, release_rows)
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

    def lowering(self, executor: Executor) -> Lowering:
        return CudaLowering(self, executor)

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


class _Kernels:
    """A bound op's launches for the current step shape (``plan()``); calling it launches
    them (a step's submission launches them without planning again)."""

    def __init__(self, device: CudaDevice, plan: Callable[[], list[Launch]]) -> None:
        self._device, self.plan = device, plan

    def launches(self) -> list[Call]:
        calls = []
        for program, spec, entry, args, rows in self.plan():
            fn, where = self._device.function(program, spec, entry)
            launch = self._device.context.launch
            calls.append(functools.partial(launch, fn, where.grid(rows), (args, rows)))
        return calls

    def __call__(self) -> None:
        for launch in self.launches():
            launch()


class CudaLowering(Lowering):
    """One graph's ops bound on a ``CudaDevice`` (see the module docstring)."""

    cached_rows = CACHED_ROWS

    def __init__(self, device: CudaDevice, executor: Executor) -> None:
        super().__init__(device, executor)
        self.device: CudaDevice = device
        self._context = device.context
        self._scratch: DeviceArray | None = None  # auto matmuls' quantised activations
        self._scratch_at = (0, 0, 0, 0)  # offsets of the quants, scales, sums, key sums
        self._step = device.alloc(8 * attention_program.N_STEP, owner=self)  # layout block
        self._arena: DeviceArray | None = None  # the step layout's arrays
        self._kv: object = None
        self._shape = (0, 0)

    # -- binding ---------------------------------------------------------------------
    def reserve(self, rows: int, widest: int) -> None:
        sizes = ActivationScratch.sizes(rows, widest) if widest else (0, 0, 0, 0)
        if self._scratch is None or sum(sizes) > self._scratch.nbytes:
            if self._scratch is not None:
                self.device.free(self._scratch)
            self._scratch = self.device.alloc(sum(sizes))
        self._scratch_at = tuple(int(at) for at in np.cumsum((0, *sizes[:-1])))

    def begin_bind(self) -> None:
        self._table = np.zeros((2 * len(self.ex.graph.nodes) + 1, WORDS), np.int64)
        self._table_copy = self.device.alloc(self._table.nbytes, owner=self._table)
        self._used = 0
        self._on_resize: list[Callable[[int, int], None]] = []

    def end_bind(self) -> None:
        pass

    def _block(self) -> tuple[np.ndarray, int]:
        """A fresh argument block: its host row and its device address."""
        i, self._used = self._used, self._used + 1
        return self._table[i], self._table_copy.ptr + i * WORDS * 8

    def _rows(self, symbol: str) -> int:
        return self._shape[0] if symbol == "T" else self._shape[1]

    def _elementwise(
        self, bind: Callable[..., elementwise.BoundKernel], *args: object, rows: str
    ) -> _Kernels:
        """A kernel bound with ``core.elementwise``'s binder over full buffers, its array
        addresses then replaced by their device copies'; its count follows the step."""
        block, at = self._block()
        bound = bind(*args, block=block, backend=self.device.backend)
        _, program, spec = bound.request
        block[1 : 1 + len(bound.arrays)] = [self.device.address(a) for a in bound.arrays]
        per_row = int(block[0]) // self.ex.capacity
        self._on_resize.append(lambda t, s: block.__setitem__(0, per_row * (t, s)[rows == "S"]))
        kind = program.name.removeprefix("ew_")
        return _Kernels(self.device, lambda: [(program, spec, kind, at, int(block[0]))])

    def _values(self, node: Node) -> tuple[np.ndarray, list[np.ndarray], str]:
        """The output's full buffer, the operands', and the output's row symbol."""
        full = self.ex.full
        return full[node.out.id], [full[x.id] for x in node.args], str(node.out.type.shape[0])

    # The op table: each op this device has kernels for -> the method that binds it.
    def _embed(self, node: Node) -> Call:
        ex = self.ex
        lookup = ex.prepare(node.weights[0].name, "embedding")
        ids, out = ex.view_of[node.args[0].id], ex.view_of[node.out.id]
        copy, offset = self.device.device_view(ex.full[node.out.id])

        def embed() -> None:  # rows looked up on the host, copied in
            rows = ex.views[out]
            lookup(ex.views[ids], rows)
            self._context.copy_in(copy, rows, offset)

        return embed

    def _matmul(self, node: Node) -> _Kernels:
        out, (x, *rest), _ = self._values(node)
        weights = [w.name for w in node.weights]
        if len(weights) > 1:
            raise InvalidRequest(f"{weights[1]}: the CUDA preview has no matmul bias kernel")
        mm: CudaMatmul = self.ex.prepare(weights[0], "matmul")
        kernels, address = mm.kernels, self.device.address
        args, args_at = self._block()
        args[A_W], args[A_NB], args[A_LDY], args[A_Y] = (
            mm.weights.ptr, mm.n_cols // QK, mm.n_rows, address(out)
        )  # fmt: skip
        x_rows = str(node.args[0].type.shape[0])
        blocks = [args]
        if kernels.mode == "exact":
            args[A_X] = address(x)
        else:  # quantise x into the scratch first
            qargs, qargs_at = self._block()
            for slot, at in zip((A_X, A_XD, A_XS, A_XK), self._scratch_at, strict=True):
                args[slot] = qargs[slot] = self._scratch.ptr + at  # type: ignore[union-attr]
            qargs[A_NB], qargs[A_Y] = mm.n_cols // QK, address(x)
            blocks.append(qargs)

        def resize(t: int, s: int) -> None:
            for block in blocks:
                block[A_T] = (t, s)[x_rows == "S"]

        self._on_resize.append(resize)
        after = None
        if node.op == "matmul_add":  # the fused residual: out += x_residual
            after = self._elementwise(elementwise.add, out, out, rest[0], rows=x_rows)

        def plan() -> list[Launch]:
            t = self._rows(x_rows)
            which = kernels.tile_for(t)
            launches = [(MATMUL, kernels.specs[which], "", args_at, mm.n_rows)]
            if kernels.mode == "auto":
                launches.insert(0, (MATMUL, kernels.specs[kernels.quantize], "", qargs_at, t))
            return launches + (after.plan() if after else [])

        return _Kernels(self.device, plan)

    def _norm(self, node: Node) -> _Kernels:
        out, (x,), rows = self._values(node)
        a = node.attrs
        weight = self.ex.prepare(node.weights[0].name, "vector")
        width = a.get("head_dim", out.shape[1])  # a head norm is a norm of head rows
        x, y = x.reshape(-1, width), out.reshape(-1, width)
        return self._elementwise(elementwise.rms_norm, y, x, weight, a["eps"], rows=rows)

    def _rope(self, node: Node) -> _Kernels:
        out, ins, rows = self._values(node)
        a = node.attrs
        table = self.rope_table(node)
        tables = (self.device.mirror(table.cos), self.device.mirror(table.sin))
        shape = (a["head_dim"], a["rope_dim"], a["neox"])
        return self._elementwise(elementwise.rope, out, *ins, *tables, *shape, rows=rows)

    def _add(self, node: Node) -> _Kernels:
        out, (x, y), rows = self._values(node)
        return self._elementwise(elementwise.add, out, x, y, rows=rows)

    def _gated(self, node: Node) -> _Kernels:
        out, ins, rows = self._values(node)
        return self._elementwise(elementwise.gated, out, *ins, GATES[node.op], rows=rows)

    def _attention(self, node: Node) -> _Kernels:
        out, (q, k, v), _ = self._values(node)
        a = node.attrs
        n_heads, n_kv, head_dim, layer = a["n_heads"], a["n_kv_heads"], a["head_dim"], a["layer"]
        if not (n_heads % n_kv == 0 and attention_program.supported(head_dim, "f32")):
            raise InvalidRequest(f"no attention kernel for {n_heads} heads of {head_dim}")
        P = attention_program  # noqa: N806 - the program's argument layout
        block, at = self._block()
        rows = len(out)
        for name, x, where, stride, heads in (
            ("q", q, P.A_Q, P.A_Q_STRIDE, n_heads),
            ("k", k, P.A_K_NEW, P.A_K_STRIDE, n_kv),
            ("v", v, P.A_V_NEW, P.A_V_STRIDE, n_kv),
        ):
            block[where] = self.device.address(x)
            block[stride] = row_stride(name, x, rows, heads * head_dim)
        block[P.A_OUT], block[P.A_WINDOW], block[P.A_STEP] = (
            self.device.address(out), a["window"], self._step.ptr
        )  # fmt: skip
        block[P.A_SCALE] = struct.unpack("<q", struct.pack("<d", a["scale"]))[0]
        per_token = n_heads // P.item_heads(n_heads // n_kv)
        stores = {P.A_K: "k", P.A_V: "v", P.A_KS: "k_scale", P.A_VS: "v_scale"}
        stores |= {P.A_KR: "k_recent", P.A_VR: "v_recent"}

        def plan() -> list[Launch]:
            kv = self._kv
            if not attention_program.supported(head_dim, kv.dtype):
                raise InvalidRequest(f"no {kv.dtype} attention kernel for heads of {head_dim}")
            for where, name in stores.items():  # this layer's pages of the step's storage
                arrays = getattr(kv, name)
                block[where] = arrays[layer].ptr if arrays else 0
            geometry = (n_heads, n_kv, head_dim, kv.page_size, kv.recent)
            names = ("n_heads", "n_kv_heads", "head_dim", "page", "recent")
            spec = {"dtype": kv.dtype, **dict(zip(names, geometry, strict=True))}
            tokens = self._shape[0]
            launches = [(P.ATTENTION, spec, "write", at, 1)]
            launches.append((P.ATTENTION, spec, "items", at, tokens * per_token))
            if kv.recent:
                launches.append((P.ATTENTION, spec, "write_recent", at, 1))
            return launches

        return _Kernels(self.device, plan)

    def _select_rows(self, node: Node) -> Call:
        ex = self.ex
        out, (x, _), _ = self._values(node)
        rows = ex.view_of[node.args[1].id]
        (dst, dst_at), (src, src_at) = map(self.device.device_view, (out, x))
        n = x.strides[0]

        def select_rows() -> None:  # a device copy per row
            for i, row in enumerate(ex.views[rows].tolist()):
                self._context.copy_within(dst, dst_at + i * n, src, src_at + row * n, n)

        return select_rows

    OP_TABLE: ClassVar[dict[str, Callable[..., Call]]] = {
        "embed": _embed,
        "matmul": _matmul,
        "matmul_add": _matmul,
        "rms_norm": _norm,
        "head_rms_norm": _norm,
        "rope": _rope,
        "attention": _attention,
        "add": _add,
        **dict.fromkeys(GATES, _gated),
        "select_rows": _select_rows,
    }

    # -- running -------------------------------------------------------------------
    def begin_step(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        """Upload the step's positions and its attention layout."""
        P = attention_program  # noqa: N806
        n = len(batch.slots)
        check_layout(batch, n)
        copy, offset = self.device.device_view(positions)
        self._context.copy_in(copy, positions[:n], offset)
        pages, seq_of, *per_seq = batch.kernel_tables
        arrays = [pages, seq_of, np.ascontiguousarray(batch.slots, np.int64), *per_seq]
        packed = np.concatenate([a.ravel() for a in arrays]).astype(np.int64, copy=False)
        if self._arena is None or packed.nbytes > self._arena.nbytes:
            if self._arena is not None:
                self.device.free(self._arena)
            self._arena = self.device.alloc(max(packed.nbytes, 4096))
        self._context.copy_in(self._arena, packed)
        starts = np.cumsum([0] + [a.size for a in arrays]) * 8 + self._arena.ptr
        words = np.zeros(P.N_STEP, np.int64)
        words[[P.S_TOKENS, P.S_PAGES, P.S_MAX_PAGES, P.S_SEQ_OF]] = (
            n, starts[0], pages.shape[1], starts[1]
        )  # fmt: skip
        words[P.S_POS], words[P.S_SLOTS] = copy.ptr + offset, starts[2]
        words[[P.S_FIRST_ROW, P.S_RECENT_ROW, P.S_RECENT_FROM]] = starts[3:6]
        self._context.copy_in(self._step, words)
        self._kv = batch.kv

    def resize(self, n_tokens: int, n_logits: int) -> None:
        self._shape = (n_tokens, n_logits)
        for resize in self._on_resize:
            resize(n_tokens, n_logits)
        self._context.copy_in(self._table_copy, self._table[: self._used])

    def submission(self, calls: list[Call]) -> list[Call]:
        """The step's launches in order (their PTX lowered and loaded first) and the host
        parts between them."""
        steps: list[Call] = []
        for call in calls:
            steps += call.launches() if isinstance(call, _Kernels) else [call]
        # the blocks as this shape and KV storage bind them
        self._context.copy_in(self._table_copy, self._table[: self._used])
        return steps

    def end_step(self) -> None:
        """Copy the step's logits back (the copy waits for the launches)."""
        logits = self.ex.graph.outputs["logits"].id
        copy, offset = self.device.device_view(self.ex.full[logits])
        self._context.copy_out(copy, self.ex.views[self.ex.view_of[logits]], offset)
