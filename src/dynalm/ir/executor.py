"""The executor: binds a planned graph to a device and its weights once, then runs steps.

Binding turns every node into a zero-argument call: weights prepared by the device
(dequantised, repacked or memory-mapped, as the mode wants), JIT kernels
(``core.elementwise``) bound to the planned buffers' addresses, numpy and matmul calls
reading their operands from a table of views. A step copies its inputs into planned
input buffers and calls the list in order; only when the step's token count changes
are the views re-sliced and the kernels' row counts rewritten. Nothing is allocated,
looked up or closed over per op. A ``split`` marked ``view`` is no call at all: its value
is a view of its source's columns, which rope and attention read with a row stride. The
attention kernels read the step's layout (page tables, slots) from one block that ``run``
fills once per step.

``--mode safe`` binds the numpy references of ``core.cpu_ops`` instead of the JIT
kernels: the oracle the fast path is tested against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from dynalm.core import attention, cpu_ops, elementwise, pool
from dynalm.core.cpu_ops import AttentionBatch
from dynalm.core.device import CpuDevice
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch, QuantMatmul
from dynalm.ir.graph import Graph, Node
from dynalm.ir.ops import OPS
from dynalm.ir.planner import Plan, plan_buffers
from dynalm.kernel import backends

Call = Callable[[], None]
_GATES = {op.name: op.gate for op in OPS.values() if op.gate}  # swiglu -> silu, ...


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


class WeightSource(Protocol):
    def raw(self, name: str) -> np.ndarray: ...
    def tensor_type(self, name: str) -> int: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of ``raw(name)``, read without keeping the rest in memory."""

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """The executor holds its own copy of ``name`` (or of its ``rows``) now."""


class Executor:
    """Runs a graph step by step. ``profile``: when set to a dict, ``run`` adds each op's
    wall time (seconds, keyed by op name) to it; ``ops`` lists the op of every call."""

    def __init__(
        self, graph: Graph, device: CpuDevice, weights: WeightSource, max_tokens: int = 512
    ):
        self.graph = graph
        self.device = device
        self.plan: Plan = plan_buffers(graph)
        self.profile: dict[str, float] | None = None
        self._weights = weights
        self._native = device.mode != "safe"
        self._backend = getattr(device, "backend", None)  # lowers the native kernels
        self._scratch = ActivationScratch()  # shared by every auto matmul of this graph
        self._prepared: dict[tuple[str, str], object] = {}
        self._rope_tables: dict[tuple, cpu_ops.RopeTable] = {}
        self._rope_positions = 256  # positions the rope tables cover (they grow on demand)
        self._batch: AttentionBatch | None = None
        self._layout = attention.StepLayout()  # what the native attention kernels read
        # Merged weights (pass merge-matmuls): name -> the model tensors stacked by rows.
        self._parts: dict[str, tuple[str, ...]] = {}
        for node in graph.nodes:
            for weight, key in zip(node.weights, ("parts", "bias_parts"), strict=False):
                if key in node.attrs:
                    self._parts[weight.name] = tuple(node.attrs[key])
        # seconds spent binding and compiling (a new step shape, grown buffers or rope
        # tables): what timing a step's own cost leaves out
        self.setup_seconds = 0.0
        self._reserve(max_tokens)

    def _reserve(self, rows: int) -> None:
        self._capacity = rows
        matmuls = (n for n in self.graph.nodes if n.op in ("matmul", "matmul_add"))
        widest = max((n.args[0].type.row_width for n in matmuls), default=0)
        self._scratch.reserve(rows, widest)  # before binding: programs hold its address
        self._buffers = [np.empty((rows, w), np.float32) for w in self.plan.slot_widths]
        self._inputs = {name: np.zeros(rows, np.int64) for name in self.graph.inputs}
        self._bind_all()

    # -- binding -------------------------------------------------------------------
    def _bind_all(self) -> None:
        """Bind every node against full-capacity buffers; ``_resize`` then fits a step."""
        t0 = time.perf_counter()
        try:
            self._bind_nodes()
        finally:
            self.setup_seconds += time.perf_counter() - t0

    def _bind_nodes(self) -> None:
        graph, slot_of = self.graph, self.plan.slot_of
        self._full: dict[int, np.ndarray] = {v.id: self._inputs[n] for n, v in graph.inputs.items()}
        rows_of = {v.id: str(v.type.shape[0]) for v in graph.inputs.values()}
        for node in graph.nodes:
            if node.out.id in slot_of:
                self._full[node.out.id] = self._buffers[slot_of[node.out.id]]
            else:  # a view split
                start = node.attrs["start"]
                source = self._full[node.args[0].id]
                self._full[node.out.id] = source[:, start : start + node.out.type.row_width]
            rows_of[node.out.id] = str(node.out.type.shape[0])
        # One view per (buffer, row symbol): values sharing a slot share its view.
        self._sliced: list[tuple[np.ndarray, str]] = []
        self._view_of: dict[int, int] = {}
        where: dict[tuple[int, str], int] = {}
        for vid, array in self._full.items():
            key = (id(array), rows_of[vid])
            if key not in where:
                where[key] = len(self._sliced)
                self._sliced.append((array, rows_of[vid]))
            self._view_of[vid] = where[key]
        self._views: list[np.ndarray] = [a for a, _ in self._sliced]
        # The JIT kernels' argument blocks, one row each (a node binds at most one kernel),
        # so that a new step shape rewrites every kernel's count in one assignment.
        self._blocks = np.zeros((len(graph.nodes), elementwise.MAX_WORDS), np.int64)
        self._counted: list[tuple[int, str]] = []  # per kernel: count per row, row symbol
        # Consecutive splits of one value (merge-matmuls) run as one call.
        self._calls: list[Call] = []
        self.ops: list[str] = []
        nodes = [n for n in graph.nodes if n.out.id in slot_of]  # views need no call
        i = 0
        while i < len(nodes):
            j = i + 1
            if nodes[i].op == "split":
                while j < len(nodes) and nodes[j].op == "split" and nodes[j].args == nodes[i].args:
                    j += 1
                self._calls.append(self._split(nodes[i:j]))
            else:
                self._calls.append(self._bind(nodes[i]))
            self.ops.append(nodes[i].op)
            i = j
        self._per_row = np.array([per_row for per_row, _ in self._counted], np.int64)
        self._on_tokens = np.array([rows == "T" for _, rows in self._counted], bool)
        self._logits = self._view_of[graph.outputs["logits"].id]
        self._shape: tuple[int, int] | None = None  # (T, S) the views are sliced for
        self._compiled_kv: object = None  # the KV storage the programs were built for
        # Compiled steps of small shapes, kept: decode steps alternate between shapes (a
        # sequence joins or leaves, a speculative sequence verifies k + 1 tokens), and
        # compiling one costs ~2 decode steps of SmolLM2.
        self._compiled: dict[tuple[int, int], list[Call]] = {}

    def _resize(self, n_tokens: int, n_logits: int) -> None:
        rows = {"T": n_tokens, "S": n_logits}
        self._views[:] = [a[: rows[sym]] for a, sym in self._sliced]
        counts = np.where(self._on_tokens, n_tokens, n_logits) * self._per_row
        self._blocks[: len(counts), 0] = counts
        self._shape = (n_tokens, n_logits)
        if self._shape in self._compiled and self._batch.kv is self._compiled_kv:
            self._steps = self._compiled[self._shape]
        else:
            self._compile()

    def _compile(self) -> None:
        """Fold each run of consecutive native calls into one ``pool.Program``, so a step
        crosses from Python into native code once per run instead of once per kernel (a
        SmolLM2 decode step: 4 calls, the layers with their attention one of them, instead
        of ~480). Redone whenever the step shape or the KV storage changes.

        The kernels the step calls are lowered first, those not compiled yet together
        (``backends.lower_all``: concurrently, on threads joined before it returns): a
        kernel is still compiled only for the step that first needs it."""
        t0 = time.perf_counter()
        try:
            self._compile_programs()
        finally:
            self.setup_seconds += time.perf_counter() - t0

    def _compile_programs(self) -> None:
        self._steps: list[Call] = []
        if self._batch.kv is not self._compiled_kv:
            self._compiled.clear()  # their programs hold the old storage's addresses
        self._compiled_kv = self._batch.kv
        if self._native:
            pending = pool.pending() if pool.available() else []
            pending += [r for call in self._calls for r in getattr(call, "pending", list)()]
            if pending:
                backends.lower_all(pending)
        if self._shape is not None and self._shape[0] <= CACHED_ROWS:
            self._compiled[self._shape] = self._steps
        if not (self._native and pool.available()):
            self._steps += self._calls
            return
        run: list[tuple[int, int, int, int, int]] = []
        for call in [*self._calls, None]:
            records = getattr(call, "records", None)
            if records is not None:
                run += records()
                continue
            if run:
                self._steps.append(pool.Program(run, self.device.threads))
                run = []
            if call is not None:
                self._steps.append(call)

    def _prepare(self, name: str, use: str) -> object:
        """A weight prepared for one use (matmul, embedding, vector); done once. Mapped
        bytes a kernel has copied (repacked) are released as it goes, and embedding rows
        are read on demand, so the file's pages do not stay in memory beside the copy."""
        key = (name, use)
        if key not in self._prepared:
            raw, qtype, shape = self._raw(name, lazy=use == "matmul")
            w, parts = self._weights, self._parts.get(name)
            if use == "matmul":
                release = None if parts else lambda lo, hi: w.release(name, (lo, hi))
                source = getattr(w, "source", None)  # where the bytes lie: the repack cache key
                prepared = self.device.matmul(
                    raw,
                    qtype,
                    shape,
                    scratch=self._scratch,
                    release_rows=release,
                    source=source(parts or (name,)) if source else None,
                )
                if isinstance(prepared, QuantMatmul) and parts:  # stacked parts: a copy
                    for part in parts:
                        w.release(part)
            elif use == "embedding":
                rows = None if parts else lambda ids: w.read_rows(name, ids)
                prepared = self.device.embedding(raw, qtype, shape, read_rows=rows)
            else:
                prepared = self.device.vector(raw, qtype, shape)
            self._prepared[key] = prepared
        return self._prepared[key]

    def _raw(self, name: str, lazy: bool = False) -> tuple[object, int, tuple[int, ...]]:
        """A weight's bytes, ggml type and shape; a merged weight's parts' rows are
        concatenated (quantised rows are independent, so this is exact), by a function
        when ``lazy`` (a matmul whose repacked copy is cached never reads them)."""
        w = self._weights
        parts = self._parts.get(name)
        if parts is None:
            return w.raw(name), w.tensor_type(name), tuple(w.tensor_shape(name))
        shapes = [tuple(w.tensor_shape(p)) for p in parts]
        raw = lambda: np.concatenate([w.raw(p) for p in parts], axis=0)  # noqa: E731
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        return raw if lazy else raw(), w.tensor_type(parts[0]), shape

    def _split(self, nodes: list[Node]) -> Call:
        """Copy column ranges of one value into the planned outputs of ``split`` nodes."""
        v, src = self._views, self._view_of[nodes[0].args[0].id]
        pieces = tuple(
            (self._view_of[n.out.id], n.attrs["start"], n.attrs["start"] + n.out.type.row_width)
            for n in nodes
        )

        def split() -> None:
            x = v[src]
            for o, start, end in pieces:
                v[o][...] = x[:, start:end]

        return split

    def _kernel(
        self, bind: Callable[..., elementwise.BoundKernel], *args: object, rows: str
    ) -> elementwise.BoundKernel:
        """``bind(*args)`` a JIT kernel over full buffers, its argument block a row of
        ``_blocks``, so that ``_resize`` sets its count."""
        block = self._blocks[len(self._counted)]
        kernel = bind(*args, block=block, backend=self._backend)
        self._counted.append((int(block[0]) // self._capacity, rows))
        return kernel

    def _add(self, out: int, x: int, y: int, rows: str) -> Call:
        """``out = x + y`` by value id."""
        if self._native:
            full = self._full
            return self._kernel(elementwise.add, full[out], full[x], full[y], rows=rows)
        v, o, a, b = self._views, self._view_of[out], self._view_of[x], self._view_of[y]
        return lambda: np.add(v[a], v[b], out=v[o])

    def _rope_table(self, node: Node) -> cpu_ops.RopeTable:
        a, w = node.attrs, [wt.name for wt in node.weights]
        key = (a["rope_dim"], a["base"], a["scale"], w[0] if w else None)
        if key not in self._rope_tables:
            factors = self._prepare(w[0], "vector") if w else None
            self._rope_tables[key] = cpu_ops.RopeTable(
                a["rope_dim"], a["base"], a["scale"], factors
            )
        table = self._rope_tables[key]
        table.ensure(self._rope_positions)
        return table

    def _bind(self, node: Node) -> Call:
        a, op, native = node.attrs, node.op, self._native
        w = [wt.name for wt in node.weights]
        v, full = self._views, self._full
        args = [self._view_of[x.id] for x in node.args]
        o = self._view_of[node.out.id]
        out, ins = full[node.out.id], [full[x.id] for x in node.args]
        rows = str(node.out.type.shape[0])
        if op == "embed":
            lookup = self._prepare(w[0], "embedding")
            return lambda: lookup(v[args[0]], v[o])
        if op in ("matmul", "matmul_add"):
            mm = self._prepare(w[0], "matmul")
            x = args[0]
            after = []
            if len(w) > 1:
                bias = self._prepare(w[1], "vector")
                after.append(lambda: np.add(v[o], bias, out=v[o]))
            if op == "matmul_add":  # the fused residual: out += x_residual
                after.append(self._add(node.out.id, node.out.id, node.args[1].id, rows))
            if isinstance(mm, QuantMatmul) and all(hasattr(f, "records") for f in after):
                return _Matmul(mm, v, x, o, tuple(after))
            if not after:
                return lambda: mm(v[x], v[o])

            def matmul_then(mm=mm, x=x, after=tuple(after)) -> None:
                mm(v[x], v[o])
                for f in after:
                    f()

            return matmul_then
        if op in ("rms_norm", "head_rms_norm"):
            weight = self._prepare(w[0], "vector")
            if native:
                width = a.get("head_dim", out.shape[1])  # a head norm is a norm of head rows
                x, y = ins[0].reshape(-1, width), out.reshape(-1, width)
                return self._kernel(elementwise.rms_norm, y, x, weight, a["eps"], rows=rows)
            if op == "rms_norm":
                return lambda: cpu_ops.rms_norm(v[o], v[args[0]], weight, a["eps"])
            return lambda: cpu_ops.head_rms_norm(v[o], v[args[0]], weight, a["eps"], a["head_dim"])
        if op == "rope":
            table = self._rope_table(node)
            shape = (a["head_dim"], a["rope_dim"], a["neox"])
            if native:
                tables = (table.cos, table.sin)
                return self._kernel(elementwise.rope, out, *ins, *tables, *shape, rows=rows)
            return lambda: cpu_ops.rope(v[o], v[args[0]], v[args[1]], table, *shape)
        if op == "attention":
            q, k, vv = args
            pos = self._view_of[self.graph.inputs["positions"].id]
            layer, n_kv, head_dim = a["layer"], a["n_kv_heads"], a["head_dim"]
            if native and attention.supported(head_dim, "f32"):
                geometry = (a["n_heads"], n_kv, head_dim, a["scale"], a["window"])
                return attention.PagedAttention(
                    self._layout,
                    layer,
                    *geometry,
                    self.device.threads,
                    out,
                    *ins,
                    backend=self._backend,
                )
            attrs = (layer, a["n_heads"], n_kv, head_dim, a["scale"], a["window"])
            return lambda: cpu_ops.attention(v[o], v[q], v[k], v[vv], v[pos], self._batch, *attrs)
        if op == "add":
            return self._add(node.out.id, node.args[0].id, node.args[1].id, rows)
        if op in _GATES:
            if native:
                return self._kernel(elementwise.gated, out, *ins, _GATES[op], rows=rows)
            return lambda: cpu_ops.gated(v[o], v[args[0]], v[args[1]], _GATES[op])
        if op == "mul":
            return lambda: np.multiply(v[args[0]], v[args[1]], out=v[o])
        if op == "scale":
            factor = np.float32(a["factor"])
            return lambda: np.multiply(v[args[0]], factor, out=v[o])
        if op == "silu":
            return lambda: cpu_ops.silu(v[o], v[args[0]])
        if op == "gelu_tanh":
            return lambda: cpu_ops.gelu_tanh(v[o], v[args[0]])
        if op == "select_rows":
            return lambda: np.take(v[args[0]], v[args[1]], axis=0, out=v[o])
        if op == "gather_cols":
            index = self._weights.raw(w[0]).view(np.int32).copy()  # a small index, owned
            self._weights.release(w[0])
            return lambda: np.take(v[args[0]], index, axis=1, out=v[o])
        raise NotImplementedError(f"the CPU device has no kernel for op '{op}'")

    # -- running -------------------------------------------------------------------
    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        logit_rows: np.ndarray,
        batch: AttentionBatch,
    ) -> np.ndarray:
        """One forward step over a flat batch; returns logits ``[len(logit_rows), vocab]``
        (a view into a planned buffer, valid until the next step)."""
        n_tokens, n_logits = len(tokens), len(logit_rows)
        if n_tokens > self._capacity:
            self._reserve(n_tokens)
        need = int(positions.max()) + 1 if n_tokens else 0
        if need > self._rope_positions and self._rope_tables:
            self._rope_positions = max(need, 2 * self._rope_positions)
            self._bind_all()  # the JIT rope kernels hold the tables' addresses
        ins = self._inputs
        ins["tokens"][:n_tokens] = tokens
        ins["positions"][:n_tokens] = positions
        ins["logit_rows"][:n_logits] = logit_rows
        self._batch = batch
        if self._native:
            self._layout.set(batch, ins["positions"])
        if self._shape != (n_tokens, n_logits):
            self._resize(n_tokens, n_logits)
        elif batch.kv is not self._compiled_kv:  # programs hold the KV pages' addresses
            self._compile()
        if self.profile is None:
            for call in self._steps:
                call()
        else:
            self._run_profiled(self.profile)
        return self._views[self._logits]

    def _run_profiled(self, profile: dict[str, float]) -> None:
        clock = time.perf_counter
        for op, call in zip(self.ops, self._calls, strict=True):
            t0 = clock()
            call()
            profile[op] = profile.get(op, 0.0) + clock() - t0
