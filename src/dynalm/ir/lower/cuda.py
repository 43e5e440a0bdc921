"""How a graph's ops bind on the CUDA device (preview): its op table and its step
submission.

The programs are the CPU's, at 8 lanes: the element-wise kernels are bound with
``core.elementwise``'s binders (their checks and specialisation), then their arrays'
addresses replaced by the device copies' (``CudaDevice.address``); matmul and attention
blocks are written here from the programs' argument layouts (``kernel.matmul_programs.A_*``,
``kernel.attention_program.A_*``). The blocks are rows of one table in device memory,
uploaded when a step shape or the KV storage changes. The executor writes a step's inputs on
the host; ``begin_step`` uploads them (token ids, positions, logit rows) and the attention
layout, and from there the step is device work: the embedding rows and ``select_rows`` are
row-gather kernels (``elementwise.rows``), until ``end_step`` copies the logits back.

A step is one submission: its launches in graph order, each over the grid
``nvptx.Entry.grid`` gives its rows, captured once per step shape as a CUDA graph and
replayed by one ``cuGraphLaunch`` (the shapes the executor keeps, up to ``cached_rows``
tokens; a longer prefill runs once, launched kernel by kernel); then the logits copied back
(which waits for them).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

import numpy as np

from dynalm.core import elementwise
from dynalm.core.attention import check_layout, row_stride
from dynalm.core.cuda_device import CudaDevice, CudaMatmul
from dynalm.core.cuda_driver import DeviceArray
from dynalm.core.kv_storage import AttentionBatch
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch
from dynalm.errors import InvalidRequest
from dynalm.ir.graph import Graph, Node
from dynalm.ir.lower.base import Binder, Buffers, Call, Prepare
from dynalm.ir.ops import GATES
from dynalm.kernel import attention_program, sampling_program
from dynalm.kernel.backends import Program, Spec
from dynalm.kernel.formats import QK
from dynalm.kernel.matmul_programs import (
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
)
from dynalm.kernel.matmul_programs import N_ARGS as MATMUL_ARGS

WORDS = max(MATMUL_ARGS, attention_program.N_ARGS, elementwise.MAX_WORDS)  # per block
# One launch of a step: (program, spec, entry, argument block's device address, rows).
Launch = tuple[Program, Spec, str, int, int]


class _Kernels:
    """A bound op's launches for the current step shape (``plan()``); calling it launches
    them (a step's submission launches them without planning again)."""

    def __init__(self, device: CudaDevice, plan: Callable[[], list[Launch]]) -> None:
        self._device, self.plan = device, plan

    def launches(self, stream: object = None) -> list[Call]:
        """The launches, on ``stream`` (the default stream when None)."""
        calls = []
        for program, spec, entry, args, rows in self.plan():
            fn, where = self._device.function(program, spec, entry)
            launch = functools.partial(self._device.context.launch, stream=stream)
            calls.append(functools.partial(launch, fn, where.grid(rows), (args, rows)))
        return calls

    def __call__(self) -> None:
        for launch in self.launches():
            launch()


class CudaBinder(Binder):
    """One graph's ops bound on a ``CudaDevice`` (see the module docstring)."""

    cached_rows = CACHED_ROWS
    # Steps of at most this many tokens run split-K attention (a decode batch, a short
    # prefill chunk: too few items to fill a GPU); longer ones a thread per item.
    split_rows = 16

    def __init__(self, device: CudaDevice, graph: Graph, prepare: Prepare) -> None:
        super().__init__(device, graph, prepare)
        self.device: CudaDevice = device
        self._context = device.context
        self._scratch: DeviceArray | None = None  # auto matmuls' quantised activations
        self._scratch_at = (0, 0, 0, 0)  # offsets of the quants, scales, sums, key sums
        self._step = device.alloc(8 * attention_program.N_STEP, owner=self)  # layout block
        self._parts: DeviceArray | None = None  # split-K attention's partials
        self._arena: DeviceArray | None = None  # the step layout's arrays
        self._kv: object = None
        self._shape = (0, 0)
        self._stream: object = None  # the stream the step graphs are captured on
        # the greedy tokens: the logits buffer they are of, their launches and device array
        self._greedy: tuple[np.ndarray, _Kernels, DeviceArray] | None = None

    # -- binding ---------------------------------------------------------------------
    def reserve(self, rows: int, widest: int) -> None:
        sizes = ActivationScratch.sizes(rows, widest) if widest else (0, 0, 0, 0)
        if self._scratch is None or sum(sizes) > self._scratch.nbytes:
            if self._scratch is not None:
                self.device.free(self._scratch)
            self._scratch = self.device.alloc(sum(sizes))
        self._scratch_at = tuple(int(at) for at in np.cumsum((0, *sizes[:-1])))

    def begin_bind(self, buffers: Buffers) -> None:
        super().begin_bind(buffers)
        # at most four blocks a node: an auto matmul's quantiser and product, bias, residual
        self._table = np.zeros((4 * len(self.graph.nodes) + 1, WORDS), np.int64)
        self._table_copy = self.device.alloc(self._table.nbytes, owner=self._table)
        self._used = 0
        self._on_resize: list[Callable[[int, int], None]] = []

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
        per_row = int(block[0]) // self.buffers.capacity
        self._on_resize.append(lambda t, s: block.__setitem__(0, per_row * (t, s)[rows == "S"]))
        kind = program.name.removeprefix("ew_")
        return _Kernels(self.device, lambda: [(program, spec, kind, at, int(block[0]))])

    def _values(self, node: Node) -> tuple[np.ndarray, list[np.ndarray], str]:
        """The output's full buffer, the operands', and the output's row symbol."""
        full = self.buffers.full
        return full[node.out.id], [full[x.id] for x in node.args], str(node.out.type.shape[0])

    # The op table (``base.BIND_METHODS``): each op this device has kernels for.
    def _embed(self, node: Node) -> _Kernels:
        out, (ids,), rows = self._values(node)
        table = self.prepare(node.weights[0].name, "embedding")  # dense, on the device
        return self._elementwise(elementwise.rows, out, table, ids, rows=rows)

    def _matmul(self, node: Node) -> _Kernels:
        out, (x, *rest), _ = self._values(node)
        weights = [w.name for w in node.weights]
        mm: CudaMatmul = self.prepare(weights[0], "matmul")
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
        after = []  # the epilogues, in the CPU's order: bias, then the fused residual
        if len(weights) > 1:
            b = self.prepare(weights[1], "vector")
            after.append(self._elementwise(elementwise.bias, out, out, b, rows=x_rows))
        if node.op == "matmul_add":  # out += x_residual
            after.append(self._elementwise(elementwise.add, out, out, rest[0], rows=x_rows))

        def plan() -> list[Launch]:
            t = self._rows(x_rows)
            which = kernels.tile_for(t)
            launches = [(MATMUL, kernels.specs[which], "", args_at, mm.n_rows)]
            if kernels.mode == "auto":
                launches.insert(0, (MATMUL, kernels.specs[kernels.quantize], "", qargs_at, t))
            return launches + [launch for kernels in after for launch in kernels.plan()]

        return _Kernels(self.device, plan)

    def _norm(self, node: Node) -> _Kernels:
        out, (x,), rows = self._values(node)
        a = node.attrs
        weight = self.prepare(node.weights[0].name, "vector")
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

    def _mul(self, node: Node) -> _Kernels:
        out, (x, y), rows = self._values(node)
        return self._elementwise(elementwise.mul, out, x, y, rows=rows)

    def _scale(self, node: Node) -> _Kernels:
        out, (x,), rows = self._values(node)
        return self._elementwise(elementwise.scale, out, x, node.attrs["factor"], rows=rows)

    def _activation(self, node: Node) -> _Kernels:
        out, (x,), rows = self._values(node)
        return self._elementwise(elementwise.activation, out, x, node.op, rows=rows)

    def _gather_cols(self, node: Node) -> _Kernels:
        out, (x,), rows = self._values(node)
        index = self.device.mirror(self.prepare(node.weights[0].name, "index"))
        return self._elementwise(elementwise.columns, out, x, 0, index, rows=rows)

    def _split(self, nodes: list[Node]) -> _Kernels:
        """The copied column ranges of one value: a column-copy kernel per output."""
        pieces = []
        for node in nodes:
            out, (x,), rows = self._values(node)
            start = node.attrs["start"]
            pieces.append(self._elementwise(elementwise.columns, out, x, start, rows=rows))
        return _Kernels(self.device, lambda: [launch for p in pieces for launch in p.plan()])

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
            geometry = (n_heads, n_kv, head_dim, kv.page_size, kv.recent, a.get("softcap", 0.0))
            names = ("n_heads", "n_kv_heads", "head_dim", "page", "recent", "softcap")
            spec = {"dtype": kv.dtype, **dict(zip(names, geometry, strict=True))}
            tokens = self._shape[0]
            items = tokens * per_token
            launches = [(P.ATTENTION, spec, "write_rows", at, tokens * n_kv)]  # a thread per row
            if tokens <= self.split_rows:  # split-K: a thread per item and chunk, then merge
                capacity = kv.geometry.slot_shape[0]
                block[P.A_SLICES] = P.chunks(capacity)
                self._reserve_parts(P.parts_bytes(items, capacity, n_heads, n_kv, head_dim))
                launches.append((P.ATTENTION, spec, "parts", at, items * P.chunks(capacity)))
                launches.append((P.ATTENTION, spec, "merge", at, items))
            else:  # a long prefill: a thread per item (its chunks in turn), no scratch
                launches.append((P.ATTENTION, spec, "items", at, items))
            if kv.recent:
                launches.append((P.ATTENTION, spec, "write_recent", at, 1))
            return launches

        return _Kernels(self.device, plan)

    def _reserve_parts(self, nbytes: int) -> None:
        """At least ``nbytes`` of split-K scratch (shared by the layers, whose launches run
        in order), its address in the layout block."""
        if self._parts is not None and self._parts.nbytes >= nbytes:
            return
        if self._parts is not None:
            self.device.free(self._parts)
        self._parts = self.device.alloc(nbytes)
        word = np.array([self._parts.ptr], np.int64)
        self._context.copy_in(self._step, word, 8 * attention_program.S_PARTS)

    def _select_rows(self, node: Node) -> _Kernels:
        out, (x, index), rows = self._values(node)
        return self._elementwise(elementwise.rows, out, x, index, rows=rows)

    # -- running -------------------------------------------------------------------
    def begin_step(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        """Upload the step's inputs (token ids, positions, logit rows: the whole buffers, a
        few KiB) and its attention layout: all a captured step reads that changes."""
        P = attention_program  # noqa: N806
        n = len(batch.slots)
        check_layout(batch, n)
        for value in self.graph.inputs.values():  # token ids, positions, logit rows
            host = self.buffers.full[value.id]
            copy, offset = self.device.device_view(host)
            self._context.copy_in(copy, host, offset)
        copy, offset = self.device.device_view(positions)
        pages, seq_of, *per_seq = batch.kernel_tables
        order = np.arange(n, dtype=np.int64)  # each token alone: the device runs no tiles
        slots = np.ascontiguousarray(batch.slots, np.int64)
        arrays = [pages, seq_of, slots, *per_seq, order]
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
        words[[P.S_FIRST_ROW, P.S_RECENT_ROW, P.S_RECENT_FROM, P.S_ORDER]] = starts[3:7]
        words[P.S_SINGLES] = n
        words[P.S_PARTS] = self._parts.ptr if self._parts is not None else 0
        self._context.copy_in(self._step, words)
        self._kv = batch.kv

    def resize(self, n_tokens: int, n_logits: int) -> None:
        self._shape = (n_tokens, n_logits)
        for resize in self._on_resize:
            resize(n_tokens, n_logits)
        self._context.copy_in(self._table_copy, self._table[: self._used])

    device_greedy = True

    def _argmax(self) -> tuple[_Kernels, DeviceArray]:
        """The greedy tokens of the logit rows (``sampling_program.ARGMAX``: a partial per
        ``ARGMAX_CHUNK`` logits, then a pick per row), launched at the end of every step
        (two launches, a few microseconds on a GPU), so that ``end_step(greedy=True)``
        downloads 8 bytes a row instead of the vocabulary's floats."""
        logits = self.buffers.full[self.graph.outputs["logits"].id]
        capacity, vocab = logits.shape
        if self._greedy is not None and self._greedy[0] is logits:
            return self._greedy[1:]
        chunks = sampling_program.argmax_chunks(vocab)
        # freed with the logits buffer (a new capacity plans new buffers)
        parts = self.device.alloc(12 * capacity * chunks, owner=logits)  # i64 index, f32 max
        tokens = self.device.alloc(8 * capacity, owner=logits)
        block = self.device.alloc(8 * sampling_program.G_WORDS, owner=logits)
        words = (self.device.address(logits), parts.ptr + 8 * capacity * chunks, parts.ptr)
        self._context.copy_in(block, np.array((*words, tokens.ptr), np.int64))
        spec, program = {"vocab": vocab}, sampling_program.ARGMAX

        def plan() -> list[Launch]:
            rows = self._shape[1]
            parts = (program, spec, "parts", block.ptr, rows * chunks)  # a thread each
            return [parts, (program, spec, "pick", block.ptr, rows)]

        self._greedy = (logits, _Kernels(self.device, plan), tokens)
        return self._greedy[1:]

    def submission(self, calls: list[Call]) -> list[Call]:
        """The step's launches (their PTX lowered and loaded first) captured as one CUDA
        graph on the binder's stream: one ``cuGraphLaunch`` a step. The capture holds this
        shape's launches (grids, row counts, argument-block addresses); everything a step
        changes is device memory they read (the inputs, the layout block, the blocks'
        counts), so a step of the same shape replays it. A shape of more than
        ``cached_rows`` tokens (a long prefill: the executor does not keep its submission, so
        a graph would be instantiated to run once), or ``device.graphs`` off: the launches
        one by one on the default stream. The greedy tokens' launches end every step."""
        calls = [*calls, self._argmax()[0]]
        if not self.device.graphs or self._shape[0] > self.cached_rows:
            steps: list[Call] = []
            for call in calls:
                steps += call.launches() if isinstance(call, _Kernels) else [call]
            kernels = len(steps)
        else:
            if self._stream is None:
                self._stream = self._context.stream(owner=self)
            launches = [launch for call in calls for launch in call.launches(self._stream)]  # type: ignore[attr-defined]

            def record() -> None:
                for launch in launches:
                    launch()

            graph = self._context.capture(self._stream, record)
            steps, kernels = [functools.partial(graph.launch, self._stream)], len(launches)
        self.device.submitted[self._shape] = (len(steps), kernels)
        # the blocks as this shape and KV storage bind them
        self._context.copy_in(self._table_copy, self._table[: self._used])
        return steps

    def end_step(self, greedy: bool = False) -> np.ndarray | None:
        """Copy the step's logits back, or with ``greedy`` its greedy tokens (the copy
        waits for the launches)."""
        if greedy:
            tokens = np.empty(self._shape[1], np.int64)
            return self._context.copy_out(self._argmax()[1], tokens)
        bufs, logits = self.buffers, self.graph.outputs["logits"].id
        copy, offset = self.device.device_view(bufs.full[logits])
        self._context.copy_out(copy, bufs.views[bufs.view_of[logits]], offset)
