"""How a graph's ops bind on the CPU device: its op table and its step submission.

Each op binds to a zero-argument call over the executor's planned buffers: JIT kernels
(``core.elementwise``, ``core.attention``, ``core.matmul``) bound to the buffers'
addresses, or numpy calls reading their operands from the executor's table of views
(``--mode safe`` binds the numpy references of ``core.cpu_ops``: the oracle the fast path
is tested against). The JIT kernels' argument blocks are rows of one array, so a new step
shape rewrites every kernel's row count in one assignment. The attention kernels read the
step's layout (page tables, slots) from one ``StepLayout`` block filled once per step.

A step is one submission: each run of consecutive native calls is folded into one
``pool.Program``, so a step crosses from Python into native code once per run instead of
once per kernel; the kernels a step calls are lowered first, the pending ones together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dynalm.core import attention, cpu_ops, elementwise, pool
from dynalm.core.experts import Experts, ExpertScratch, MatmulFn
from dynalm.core.kv_storage import AttentionBatch
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch, QuantMatmul
from dynalm.ir.graph import Graph, Node
from dynalm.ir.lower.base import Binder, Buffers, Call, Prepare
from dynalm.ir.ops import GATES
from dynalm.kernel import backends

if TYPE_CHECKING:
    from dynalm.core.cpu_device import CpuDevice


class _Matmul:
    """``out = x @ W^T`` with a JIT matmul, then native epilogues (the fused residual add)."""

    def __init__(
        self, mm: QuantMatmul, views: list[np.ndarray], x: int, o: int, after: tuple
    ) -> None:
        self._mm, self._views, self._x, self._o, self._after = mm, views, x, o, after

    def __call__(self) -> None:
        self._mm(self._views[self._x], self._views[self._o])
        for kernel in self._after:
            kernel()

    def pending(self) -> list[backends.Request]:
        """The kernels this step calls that are not lowered yet."""
        calls = self._mm.pending(len(self._views[self._x]))
        return calls + [r for kernel in self._after for r in kernel.pending()]

    def records(self) -> list[tuple[int, int, int, int, int]]:
        """The native calls, as ``pool.Program`` records."""
        calls = self._mm.records(self._views[self._x], self._views[self._o])
        return calls + [r for kernel in self._after for r in kernel.records()]


class _Kernels:
    """JIT kernels bound for one call (a run of splits), run in order."""

    def __init__(self, kernels: tuple[elementwise.BoundKernel, ...]) -> None:
        self._kernels = kernels

    def __call__(self) -> None:
        for kernel in self._kernels:
            kernel()

    def pending(self) -> list[backends.Request]:
        return [r for kernel in self._kernels for r in kernel.pending()]

    def records(self) -> list[tuple[int, int, int, int, int]]:
        return [r for kernel in self._kernels for r in kernel.records()]


# Lane-wise ops of two values of one shape: the order of their rows is free
_ROW_FREE = frozenset({*GATES, "swiglu_oai"})


def expert_ffns(graph: Graph) -> tuple[set[int], set[int]]:
    """An expert FFN's matmuls that may keep their rows in expert order (``Experts``'
    ``sorted_x`` and ``sorted_out``): where an ``expert_matmul`` reads a gated op (swiglu,
    geglu, swiglu_oai) of two ``expert_matmul`` outputs of the same route that nothing
    else reads, the two write their products in expert order and it reads them so (the
    gated op is lane-wise). Returns the output ids of the readers (``sorted_x``) and of
    the two (``sorted_out``)."""
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for arg in node.args:
            readers[arg.id] = readers.get(arg.id, 0) + 1
    for value in graph.outputs.values():
        readers[value.id] = readers.get(value.id, 0) + 1
    made = {node.out.id: node for node in graph.nodes}
    sorted_x, sorted_out = set(), set()
    for node in graph.nodes:
        if node.op != "expert_matmul":
            continue
        x, route = node.args[0].id, node.args[1].id
        gated = made.get(x)
        if gated is None or gated.op not in _ROW_FREE or readers[x] != 1:
            continue
        parts = [made.get(arg.id) for arg in gated.args]
        if all(
            p is not None
            and p.op == "expert_matmul"
            and p.args[1].id == route
            and readers[p.out.id] == 1
            for p in parts
        ):
            sorted_x.add(node.out.id)
            sorted_out.update(p.out.id for p in parts if p is not None)
    return sorted_x, sorted_out


class _ExpertMatmul:
    """``expert_matmul`` on JIT experts: ``core.experts``' Python grouping, except in a
    compiled step of up to ``Experts.native_tokens`` (the fewest of the graph's): native
    records (bound once per step shape: ``Experts.step_records``)."""

    def __init__(
        self,
        experts: Experts,
        views: list[np.ndarray],
        operands: tuple[int, int, int],
        bias: np.ndarray | None,
        backend: backends.Backend,
        graph_experts: list[tuple[Experts, int]],
        order: tuple[bool, bool] = (False, False),
    ) -> None:
        self._experts, self._views, self._bias, self._backend = experts, views, bias, backend
        self._x, self._route, self._o = operands
        self._graph_experts = graph_experts  # every expert matmul's experts and top_k
        self._order = order  # (sorted_x, sorted_out) of a step too large to run natively
        self._most_native: int | None = None
        # per step size: the native records and what they point into
        self._native: dict[int, tuple[list[tuple[int, int, int, int, int]], tuple]] = {}

    def _from_python(self, tokens: int) -> bool:
        """Whether every expert matmul of a step of ``tokens`` runs from Python: one from
        Python would break the step's native program anyway, so all or none run natively.
        (The graph's fewest native tokens, taken once its binding is done: steps run after.)"""
        if self._most_native is None:
            self._most_native = min(e.native_tokens(k) for e, k in self._graph_experts)
        return tokens > self._most_native

    def __call__(self) -> None:
        v = self._views
        x = v[self._x]
        # the expert-order rows of an expert FFN: only where its three matmuls all run here
        # (a step small enough runs some natively, in token order)
        sorted_x, sorted_out = self._order if self._from_python(len(x)) else (False, False)
        self._experts(
            x, v[self._route], v[self._o], self._bias, sorted_x=sorted_x, sorted_out=sorted_out
        )

    def records(self) -> list[tuple[int, int, int, int, int]] | None:
        """A small step's native calls (None: a step run from Python)."""
        v = self._views
        tokens = len(v[self._x])
        if self._from_python(tokens):
            return None
        if tokens not in self._native and self._experts.native_steps():
            operands = (v[self._x], v[self._route], v[self._o], self._bias, self._backend)
            self._native[tokens] = self._experts.step_records(*operands)
        found = self._native.get(tokens)
        return None if found is None else found[0]


class CpuBinder(Binder):
    """One graph's ops bound on a ``CpuDevice`` (see the module docstring)."""

    cached_rows = CACHED_ROWS

    def __init__(self, device: CpuDevice, graph: Graph, prepare: Prepare) -> None:
        super().__init__(device, graph, prepare)
        self._native = device.mode != "safe"
        self._backend = device.backend  # lowers the native kernels
        self._scratch = ActivationScratch()  # shared by every auto matmul of this graph
        self._expert_rows = ExpertScratch()  # and the experts' gathered rows
        self._batch: AttentionBatch | None = None
        self._layout = attention.StepLayout()  # what the native attention kernels read

    # -- binding -------------------------------------------------------------------
    def reserve(self, rows: int, widest: int) -> None:
        self._scratch.reserve(rows, widest)  # before binding: programs hold its address

    def begin_bind(self, buffers: Buffers) -> None:
        super().begin_bind(buffers)
        # up to two kernels a node (a matmul's bias and residual)
        self._blocks = np.zeros((2 * len(self.graph.nodes), elementwise.MAX_WORDS), np.int64)
        self._counted: list[tuple[int, str]] = []  # per kernel: count per row, row symbol
        self._graph_experts: list[tuple[Experts, int]] = []  # expert matmuls: experts, top_k
        self._sorted_x, self._sorted_out = expert_ffns(self.graph)

    def end_bind(self) -> None:
        self._per_row = np.array([per_row for per_row, _ in self._counted], np.int64)
        self._on_tokens = np.array([rows == "T" for _, rows in self._counted], bool)

    def prepare_matmul(self, *args: object, **kwargs: object) -> object:
        return self.device.matmul(*args, scratch=self._scratch, **kwargs)  # type: ignore[arg-type]

    def prepare_experts(
        self, shape: tuple[int, int, int], expert_bytes: int, prepare: Callable[[int], MatmulFn]
    ) -> Experts:
        """A stack of expert weights ``[E, N, K]``, expert e prepared by ``prepare(e)``
        (through ``prepare_matmul``) when a route first selects it."""
        return Experts(shape, expert_bytes, prepare, self._expert_rows)

    def _kernel(
        self, bind: Callable[..., elementwise.BoundKernel], *args: object, rows: str, **kw: object
    ) -> elementwise.BoundKernel:
        """``bind(*args, **kw)`` a JIT kernel over full buffers, its argument block a row
        of ``_blocks``, so that ``resize`` sets its count; its rows split over the threads
        where a step has enough of them (``elementwise.RowsKernel``)."""
        block = self._blocks[len(self._counted)]
        threads = self.device.threads
        kernel = bind(*args, block=block, backend=self._backend, threads=threads, **kw)
        self._counted.append((int(block[0]) // self.buffers.capacity, rows))
        return kernel

    def _add_ids(self, out: int, x: int, y: int, rows: str) -> Call:
        """``out = x + y`` by value id."""
        bufs = self.buffers
        if self._native:
            full = bufs.full
            return self._kernel(elementwise.add, full[out], full[x], full[y], rows=rows)
        v, o, a, b = bufs.views, bufs.view_of[out], bufs.view_of[x], bufs.view_of[y]
        return lambda: np.add(v[a], v[b], out=v[o])

    def _operands(self, node: Node) -> tuple:
        """views, full buffers, operand view indices, output view index, output buffer,
        operand buffers, row symbol, weight names."""
        bufs = self.buffers
        args = [bufs.view_of[x.id] for x in node.args]
        out, ins = bufs.full[node.out.id], [bufs.full[x.id] for x in node.args]
        rows = str(node.out.type.shape[0])
        return (
            bufs.views,
            args,
            bufs.view_of[node.out.id],
            out,
            ins,
            rows,
            [w.name for w in node.weights],
        )

    # The op table (``base.BIND_METHODS``): each op of ``ir/ops.py``'s method.
    def _embed(self, node: Node) -> Call:
        v, args, o, *_, w = self._operands(node)
        lookup = self.prepare(w[0], "embedding")
        return lambda: lookup(v[args[0]], v[o])

    def _matmul(self, node: Node) -> Call:
        v, args, o, out, ins, rows, w = self._operands(node)
        mm = self.prepare(w[0], "matmul")
        x = args[0]
        after = []
        if len(w) > 1:
            bias = self.prepare(w[1], "vector")
            if self._native:
                after.append(self._kernel(elementwise.bias, out, out, bias, rows=rows))
            else:
                after.append(lambda: np.add(v[o], bias, out=v[o]))
        if node.op == "matmul_add":  # the fused residual: out += x_residual
            after.append(self._add_ids(node.out.id, node.out.id, node.args[1].id, rows))
        if isinstance(mm, QuantMatmul) and all(hasattr(f, "records") for f in after):
            return _Matmul(mm, v, x, o, tuple(after))
        if not after:
            return lambda: mm(v[x], v[o])

        def matmul_then(mm=mm, x=x, after=tuple(after)) -> None:
            mm(v[x], v[o])
            for f in after:
                f()

        return matmul_then

    def _norm(self, node: Node) -> Call:
        v, args, o, out, ins, rows, w = self._operands(node)
        a = node.attrs
        weight = self.prepare(w[0], "vector")
        if self._native:
            width = a.get("head_dim", out.shape[1])  # a head norm is a norm of head rows
            x, y = ins[0].reshape(-1, width), out.reshape(-1, width)
            return self._kernel(elementwise.rms_norm, y, x, weight, a["eps"], rows=rows)
        if node.op == "rms_norm":
            return lambda: cpu_ops.rms_norm(v[o], v[args[0]], weight, a["eps"])
        return lambda: cpu_ops.head_rms_norm(v[o], v[args[0]], weight, a["eps"], a["head_dim"])

    def _rope(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        a = node.attrs
        table = self.rope_table(node)
        shape = (a["head_dim"], a["rope_dim"], a["neox"])
        if self._native:
            tables = (table.cos, table.sin)
            return self._kernel(elementwise.rope, out, *ins, *tables, *shape, rows=rows)
        return lambda: cpu_ops.rope(v[o], v[args[0]], v[args[1]], table, *shape)

    def _attention(self, node: Node) -> Call:
        v, (q, k, vv), o, out, ins, *_, w = self._operands(node)
        a = node.attrs
        sinks = self.prepare(w[0], "vector") if w else None  # gpt-oss's per-head logits
        pos = self.buffers.view_of[self.graph.inputs["positions"].id]
        layer, n_kv, head_dim = a["layer"], a["n_kv_heads"], a["head_dim"]
        if self._native and attention.supported(head_dim, "f32"):
            geometry = (a["n_heads"], n_kv, head_dim, a["scale"], a["window"])
            return attention.PagedAttention(
                self._layout,
                layer,
                *geometry,
                self.device.threads,
                out,
                *ins,
                softcap=a.get("softcap", 0.0),
                sinks=sinks,
                backend=self._backend,
            )
        attrs = (layer, a["n_heads"], n_kv, head_dim, a["scale"], a["window"])
        how = {"softcap": a.get("softcap", 0.0), "sinks": sinks}
        return lambda: cpu_ops.attention(
            v[o], v[q], v[k], v[vv], v[pos], self._batch, *attrs, **how
        )

    def _add(self, node: Node) -> Call:
        return self._add_ids(
            node.out.id, node.args[0].id, node.args[1].id, str(node.out.type.shape[0])
        )

    def _gated(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.gated, out, *ins, GATES[node.op], rows=rows)
        return lambda: cpu_ops.gated(v[o], v[args[0]], v[args[1]], GATES[node.op])

    def _swiglu_oai(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        alpha, limit = node.attrs["alpha"], node.attrs["limit"]
        if self._native:
            oai = {"alpha": alpha, "limit": limit}
            return self._kernel(elementwise.gated, out, *ins, "swiglu_oai", rows=rows, **oai)
        return lambda: cpu_ops.swiglu_oai(v[o], v[args[0]], v[args[1]], alpha, limit)

    def _mul(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.mul, out, *ins, rows=rows)
        return lambda: np.multiply(v[args[0]], v[args[1]], out=v[o])

    def _scale(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        factor = node.attrs["factor"]
        if self._native:
            return self._kernel(elementwise.scale, out, ins[0], factor, rows=rows)
        return lambda: np.multiply(v[args[0]], np.float32(factor), out=v[o])

    def _activation(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.activation, out, ins[0], node.op, rows=rows)
        reference = getattr(cpu_ops, node.op)  # silu, gelu_tanh, tanh: the op's own name
        return lambda: reference(v[o], v[args[0]])

    # -- mixture of experts: the route and combine native; the expert matmuls native in a
    # small step (``_ExpertMatmul``), else grouped by expert from Python (data-dependent rows)
    def _moe_route(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        a = node.attrs
        attrs = (a["top_k"], a["gating"], a["normalize"], a["scale"])
        if self._native:
            return self._kernel(elementwise.moe_route, out, ins[0], *attrs, rows=rows)
        return lambda: cpu_ops.moe_route(v[o], v[args[0]], *attrs)

    def _expert_matmul(self, node: Node) -> Call:
        v, (x, route), o, *_, w = self._operands(node)
        experts = self.prepare(w[0], "experts")
        bias = self.prepare(w[1], "vector") if len(w) > 1 else None
        if self._native:  # grouped by expert, each expert's JIT matmul over its rows
            self._graph_experts.append((experts, int(node.args[1].type.shape[1]) // 2))
            order = (node.out.id in self._sorted_x, node.out.id in self._sorted_out)
            return _ExpertMatmul(
                experts, v, (x, route, o), bias, self._backend, self._graph_experts, order
            )
        shape = experts.shape
        return lambda: cpu_ops.expert_matmul(v[o], v[x], v[route], experts.matmul, shape, bias)

    def _moe_combine(self, node: Node) -> Call:
        v, (y, route), o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.combine, out, *ins, rows=rows)
        return lambda: cpu_ops.moe_combine(v[o], v[y], v[route])

    # -- the encoder's ops (bert.lum) -----------------------------------------------
    def _layer_norm(self, node: Node) -> Call:
        v, args, o, out, ins, rows, w = self._operands(node)
        weight, bias = (self.prepare(name, "vector") for name in w)
        eps = node.attrs["eps"]
        if self._native:
            return self._kernel(elementwise.layer_norm, out, ins[0], weight, bias, eps, rows=rows)
        return lambda: cpu_ops.layer_norm(v[o], v[args[0]], weight, bias, eps)

    def _gelu(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.gelu, out, ins[0], rows=rows)
        return lambda: cpu_ops.gelu(v[o], v[args[0]])

    def _l2_norm(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:
            return self._kernel(elementwise.l2_norm, out, ins[0], rows=rows)
        return lambda: cpu_ops.l2_norm(v[o], v[args[0]])

    def _pool(self, node: Node) -> Call:
        v, (x, last), o, out, ins, rows, _ = self._operands(node)
        mode = node.attrs["mode"]
        if self._native:
            return self._kernel(elementwise.pool_rows, out, *ins, mode, rows=rows)
        return lambda: cpu_ops.pool(v[o], v[x], v[last], mode)

    def _encoder_attention(self, node: Node) -> Call:
        v, (q, k, vv, last), o, out, ins, rows, _ = self._operands(node)
        head_dim, scale = node.attrs["head_dim"], node.attrs["scale"]
        if self._native:  # over the query rows, split over the threads
            bind = elementwise.encoder_attention
            return self._kernel(bind, out, *ins, head_dim, scale, rows=rows)
        return lambda: cpu_ops.encoder_attention(v[o], v[q], v[k], v[vv], v[last], head_dim, scale)

    def _select_rows(self, node: Node) -> Call:
        v, args, o, out, ins, rows, _ = self._operands(node)
        if self._native:  # the GPU's row gather
            return self._kernel(elementwise.rows, out, ins[0], ins[1], rows=rows)
        return lambda: np.take(v[args[0]], v[args[1]], axis=0, out=v[o])

    def _gather_cols(self, node: Node) -> Call:
        v, args, o, out, ins, rows, w = self._operands(node)
        index = self.prepare(w[0], "index")
        if self._native:
            return self._kernel(elementwise.columns, out, ins[0], 0, index, rows=rows)
        return lambda: np.take(v[args[0]], index, axis=1, out=v[o])

    def _split(self, nodes: list[Node]) -> Call:
        """Copy column ranges of one value into the planned outputs of ``split`` nodes."""
        bufs = self.buffers
        if self._native:
            x = bufs.full[nodes[0].args[0].id]
            return _Kernels(
                tuple(
                    self._kernel(
                        elementwise.columns, bufs.full[n.out.id], x, n.attrs["start"],
                        rows=str(n.out.type.shape[0]),
                    )
                    for n in nodes
                )
            )  # fmt: skip
        v, src = bufs.views, bufs.view_of[nodes[0].args[0].id]
        pieces = tuple(
            (bufs.view_of[n.out.id], n.attrs["start"], n.attrs["start"] + n.out.type.row_width)
            for n in nodes
        )

        def split() -> None:
            x = v[src]
            for o, start, end in pieces:
                v[o][...] = x[:, start:end]

        return split

    # -- running -------------------------------------------------------------------
    def begin_step(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        self._batch = batch
        if self._native:
            self._layout.set(batch, positions)

    def stale(self) -> bool:
        """Whether compiled steps would now run differently: their experts changed since
        (``ExpertScratch``)."""
        rows = self._expert_rows
        if rows.waiting_since is not None and rows.grouped > rows.waiting_since:
            rows.waiting_since = None
            return True
        return False

    def end_step(self, greedy: bool = False) -> None:
        error, self._expert_rows.error = self._expert_rows.error, None
        if error is not None:  # (an expert prepared inside the native step failed)
            raise error

    def resize(self, n_tokens: int, n_logits: int) -> None:
        counts = np.where(self._on_tokens, n_tokens, n_logits) * self._per_row
        self._blocks[: len(counts), 0] = counts

    def submission(self, calls: list[Call]) -> list[Call]:
        """Lower the kernels the step calls that are not compiled yet (together:
        ``backends.lower_all`` runs them concurrently, on threads joined before it
        returns), then fold each run of consecutive native calls into one ``pool.Program``
        (a SmolLM2 decode step: 4 calls, the layers with their attention one of them,
        instead of ~480)."""
        if self._native:
            pending = pool.pending() if pool.available() else []
            pending += [r for call in calls for r in getattr(call, "pending", list)()]
            if pending:
                backends.lower_all(pending)
        if not (self._native and pool.available()):
            return list(calls)
        steps: list[Call] = []
        run: list[tuple[int, int, int, int, int]] = []
        for call in [*calls, None]:
            records = getattr(call, "records", None)
            records = records() if records is not None else None
            if records is not None:
                run += records
                continue
            if run:
                steps.append(pool.Program(run, self.device.threads))
                run = []
            if call is not None:
                steps.append(call)
        return steps
