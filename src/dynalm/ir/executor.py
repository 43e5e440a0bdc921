"""The executor: binds a planned graph to a device and its weights once, then runs steps.

Binding turns every node into a zero-argument call through the op table of the device's
binder (``ir.lower``: ``ir.lower.cpu`` on the CPU): weights prepared by the device
(dequantised, repacked or memory-mapped, as the mode wants) and calls bound to the planned
buffers, which the device allocates. A step copies its inputs into planned input buffers
and runs the device's submission of the calls (on the CPU, runs of native calls folded into
one ``pool.Program`` each); only when the step's token count changes are the views
re-sliced and the kernels' row counts rewritten. Nothing is allocated, looked up or closed
over per op. A ``split`` marked ``view`` is no call at all: its value is a view of its
source's columns, which rope and attention read with a row stride.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from dynalm.core import quant
from dynalm.core.device import Device
from dynalm.core.experts import Experts
from dynalm.core.kv_storage import AttentionBatch
from dynalm.errors import ModelFormatError
from dynalm.ir.graph import Graph
from dynalm.ir.lower import binder_class
from dynalm.ir.lower.base import Buffers, Call
from dynalm.ir.ops import OPS
from dynalm.ir.planner import Plan, plan_buffers


@contextmanager
def _naming(name: str) -> Iterator[None]:
    """A weight's bytes refused (``ModelFormatError``) as it is prepared: name the tensor."""
    try:
        yield
    except ModelFormatError as e:
        raise ModelFormatError(f"tensor {name}: {e}") from None


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
        self,
        graph: Graph,
        device: Device,
        weights: WeightSource,
        max_tokens: int = 512,
        context: int = 0,
    ):
        """``context``: the most positions a sequence holds (0: not known), which picks a
        LongRoPE model's frequency factors (``Binder.context``)."""
        self.graph = graph
        self.device = device
        self.plan: Plan = plan_buffers(graph)
        self.profile: dict[str, float] | None = None
        self.weights = weights
        self._prepared: dict[tuple[str, str], object] = {}
        self._kv: object = None  # the KV storage of the current step
        self.binder = binder_class(device)(device, graph, self.prepare)
        self.binder.context = context
        # Merged weights (pass merge-matmuls): name -> the model tensors stacked by rows.
        self._parts: dict[str, tuple[str, ...]] = {}
        for node in graph.nodes:
            for weight, key in zip(node.weights, ("parts", "bias_parts"), strict=False):
                if key in node.attrs:
                    self._parts[weight.name] = tuple(node.attrs[key])
        # A weight the graph reads at more dimensions than the file gives (ggml's implicit
        # outer 1s: ``builder.check_weight_shape``): name -> the graph's shape.
        self._widened = {
            w.name: tuple(w.type.shape)
            for node in graph.nodes
            for w in node.weights
            if w is not None
            and w.name not in self._parts  # (a merged weight: no tensor of the file)
            and len(w.type.shape) > len(weights.tensor_shape(w.name))
        }
        # seconds spent binding and compiling (a new step shape, grown buffers or rope
        # tables): what timing a step's own cost leaves out
        self.setup_seconds = 0.0
        self._reserve(max_tokens)

    def _reserve(self, rows: int) -> None:
        self.capacity = rows
        matmuls = (n for n in self.graph.nodes if OPS[n.op].kernel == "matmul")
        widest = max((n.args[0].type.row_width for n in matmuls), default=0)
        self.binder.reserve(rows, widest)
        self._buffers = [self.device.buffer(rows, w) for w in self.plan.slot_widths]
        self._inputs = {
            name: self.device.buffer(rows, 1, np.int64)[:, 0] for name in self.graph.inputs
        }
        for ids in self._inputs.values():
            # rows past a step's tokens are read by no op, but stay defined; an input a
            # step does not fill (bert.lum's token_types) reads as zeros
            ids[:] = 0
        self._bind_all()

    # -- binding -------------------------------------------------------------------
    @contextmanager
    def _setup(self) -> Iterator[None]:
        """Count the time inside as setup (binding, compiling), not a step's own cost."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.setup_seconds += time.perf_counter() - t0

    def _bind_all(self) -> None:
        """Bind every node against full-capacity buffers; ``_resize`` then fits a step."""
        with self._setup():
            self._bind_nodes()

    def _bind_nodes(self) -> None:
        graph, slot_of = self.graph, self.plan.slot_of
        full: dict[int, np.ndarray] = {v.id: self._inputs[n] for n, v in graph.inputs.items()}
        rows_of = {v.id: str(v.type.shape[0]) for v in graph.inputs.values()}
        for node in graph.nodes:
            if node.out.id in slot_of:
                full[node.out.id] = self._buffers[slot_of[node.out.id]]
            else:  # a view split
                start, width = node.attrs["start"], node.out.type.row_width
                full[node.out.id] = full[node.args[0].id][:, start : start + width]
            rows_of[node.out.id] = str(node.out.type.shape[0])
        # One view per (buffer, row symbol): values sharing a slot share its view.
        self._sliced: list[tuple[np.ndarray, str]] = []
        view_of: dict[int, int] = {}
        where: dict[tuple[int, str], int] = {}
        for vid, array in full.items():
            key = (id(array), rows_of[vid])
            if key not in where:
                where[key] = len(self._sliced)
                self._sliced.append((array, rows_of[vid]))
            view_of[vid] = where[key]
        self.buffers = Buffers(self.capacity, full, [a for a, _ in self._sliced], view_of)
        # Every node through the binder's op table; consecutive splits of one value
        # (merge-matmuls) as one call.
        self.binder.begin_bind(self.buffers)
        self._calls: list[Call] = []
        self.ops: list[str] = []
        nodes = [n for n in graph.nodes if n.out.id in slot_of]  # views need no call
        i = 0
        while i < len(nodes):
            j = i + 1
            if nodes[i].op == "split":
                while j < len(nodes) and nodes[j].op == "split" and nodes[j].args == nodes[i].args:
                    j += 1
            self._calls.append(self.binder.bind(nodes[i].op, nodes[i:j]))
            self.ops.append(nodes[i].op)
            i = j
        self.binder.end_bind()
        # the graph's one output: a decoder's logits, an encoder's embeddings
        (output,) = graph.outputs.values()
        self._logits = view_of[output.id]
        self._shape: tuple[int, int] | None = None  # (T, S) the views are sliced for
        self._compiled_kv: object = None  # the KV storage the programs were built for
        # Compiled steps of small shapes, kept: decode steps alternate between shapes (a
        # sequence joins or leaves, a speculative sequence verifies k + 1 tokens), and
        # compiling one costs ~2 decode steps of SmolLM2.
        self._compiled: dict[tuple[int, int], list[Call]] = {}

    def _resize(self, n_tokens: int, n_logits: int) -> None:
        rows = {"T": n_tokens, "S": n_logits}
        self.buffers.views[:] = [a[: rows[sym]] for a, sym in self._sliced]
        self.binder.resize(n_tokens, n_logits)
        self._shape = (n_tokens, n_logits)
        if self._shape in self._compiled and self._kv is self._compiled_kv:
            self._steps = self._compiled[self._shape]
        else:
            self._compile()

    def _compile(self) -> None:
        """The step's calls as the device's submission (on the CPU: kernels not lowered yet
        lowered together, runs of native calls folded into one ``pool.Program`` each).
        Redone whenever the step shape or the KV storage changes; kept for small shapes:
        decode steps alternate between shapes (a sequence joins or leaves, a speculative
        sequence verifies k + 1 tokens), and compiling one costs ~2 decode steps of SmolLM2."""
        with self._setup():
            self._compile_submission()

    def _compile_submission(self) -> None:
        if self._kv is not self._compiled_kv:
            self._compiled.clear()  # their submissions hold the old storage's addresses
        self._compiled_kv = self._kv
        self._steps = self.binder.submission(self._calls)
        if self._shape is not None and self._shape[0] <= self.binder.cached_rows:
            self._compiled[self._shape] = self._steps

    def prepare(self, name: str, use: str) -> object:
        """A weight prepared for one use (matmul, embedding, vector, index); done once.
        Mapped bytes a kernel has copied (repacked) are released as it goes, and embedding
        rows are read on demand, so the file's pages do not stay in memory beside the copy."""
        key = (name, use)
        if key not in self._prepared:
            raw, qtype, shape = self._raw(name, lazy=use == "matmul")
            w, parts = self.weights, self._parts.get(name)
            if use == "matmul":
                prepared = self._matmul(name, raw, qtype, shape, parts)
                if self.device.holds_copy(prepared) and parts:  # stacked parts: a copy
                    for part in parts:
                        w.release(part)
            elif use == "experts":  # [E, N, K]: each expert prepared when first routed to

                def expert(e: int, raw=raw, n=shape[1]) -> object:
                    # its bytes read (or made: gpt-oss's directory) only if not cached
                    with self._setup():  # (inside a step: not the step's own cost)
                        at = lambda: raw[e]  # noqa: E731
                        return self._matmul(name, at, qtype, shape[1:], rows=e * n)

                nbytes = self.device.prepared_bytes(qtype, shape[1:], "matmul")
                prepared = self.binder.prepare_experts(shape, nbytes, expert)
            elif use == "embedding":
                # Its rows are dequantised on demand: a NaN scale would flow unseen into the
                # JIT matmuls, which swallow it (issue 31), so the table is checked once here.
                with _naming(name):
                    quant.check_scales(raw, qtype)
                if not parts:
                    w.release(name)  # (the check read it; rows are read again on demand)
                rows = None if parts else lambda ids: w.read_rows(name, ids)
                prepared = self.device.embedding(raw, qtype, shape, read_rows=rows)
            elif use == "index":  # a small host array of int32 ids, owned
                prepared = raw.view(np.int32).copy()
                w.release(name)
            else:
                prepared = self.device.vector(raw, qtype, shape)
            self._prepared[key] = prepared
        return self._prepared[key]

    def _matmul(
        self,
        name: str,
        raw: object,
        qtype: int,
        shape: tuple[int, ...],
        parts: tuple[str, ...] | None = None,
        rows: int | None = None,
    ) -> object:
        """A matmul weight (or one expert's: the tensor's rows from ``rows`` on) prepared by
        the binder; its file pages released as it is repacked, mapped from the repack cache
        when that holds it."""
        w = self.weights
        at = rows or 0
        release = None if parts else lambda lo, hi: w.release(name, (at + lo, at + hi))
        source = getattr(w, "source", None)  # where the bytes lie: the repack cache key
        where = source(parts or (name,)) if source else None
        if where is not None and rows is not None:  # one expert: its own rows of the tensor
            where = (f"{where[0]}:{rows}+{shape[0]}", where[1])
        with _naming(name):  # (its scales are checked as it is repacked)
            return self.binder.prepare_matmul(raw, qtype, shape, release_rows=release, source=where)

    def _raw(self, name: str, lazy: bool = False) -> tuple[object, int, tuple[int, ...]]:
        """A weight's bytes, ggml type and shape; a merged weight's parts' rows are
        concatenated (quantised rows are independent, so this is exact), by a function
        when ``lazy`` (a matmul whose repacked copy is cached never reads them)."""
        w = self.weights
        parts = self._parts.get(name)
        if parts is None:
            if name in self._widened:  # the same bytes, with outer dimensions of 1
                shape = self._widened[name]
                raw = w.raw(name)
                return raw.reshape(shape[:-1] + raw.shape[-1:]), w.tensor_type(name), shape
            return w.raw(name), w.tensor_type(name), tuple(w.tensor_shape(name))
        shapes = [tuple(w.tensor_shape(p)) for p in parts]
        raw = lambda: np.concatenate([w.raw(p) for p in parts], axis=0)  # noqa: E731
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        return raw if lazy else raw(), w.tensor_type(parts[0]), shape

    # -- running -------------------------------------------------------------------
    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        logit_rows: np.ndarray,
        batch: AttentionBatch,
        extra: Mapping[str, np.ndarray] | None = None,
        greedy: bool = False,
    ) -> np.ndarray:
        """One forward step over a flat batch; returns logits ``[len(logit_rows), vocab]``
        (a view into a planned buffer, valid until the next step). ``extra``: the graph's
        other inputs of one value per token, by name (bert.lum's token_types). ``greedy``
        (where ``greedy_on_device``): returns each logit row's first argmax instead (int64,
        -1 where the row holds a NaN or an infinite max), computed on the device; the
        logits do not come back."""
        if greedy and not self.greedy_on_device:
            raise ValueError(f"{type(self.binder).__name__} has no greedy tokens on its device")
        n_tokens, n_logits = len(tokens), len(logit_rows)
        if n_tokens > self.capacity:
            self._reserve(n_tokens)
        if self.binder.cover_positions(int(positions.max()) + 1 if n_tokens else 0):
            self._bind_all()
        ins = self._inputs
        ins["tokens"][:n_tokens] = tokens
        ins["positions"][:n_tokens] = positions
        ins["logit_rows"][:n_logits] = logit_rows
        for name, values in (extra or {}).items():
            if name in ins:  # a graph that reads no such input has none
                ins[name][:n_tokens] = values
        self._kv = batch.kv
        self.binder.begin_step(batch, ins["positions"])
        if self.binder.stale():
            self._compiled.clear()
            self._shape = None
        if self._shape != (n_tokens, n_logits):
            self._resize(n_tokens, n_logits)
        elif batch.kv is not self._compiled_kv:  # programs hold the KV pages' addresses
            self._compile()
        if self.profile is None:
            for call in self._steps:
                call()
        else:
            self._run_profiled(self.profile)
        tokens = self.binder.end_step(greedy)
        return tokens if greedy else self.buffers.views[self._logits]

    def expert_reads(self) -> tuple[int, int]:
        """Bytes of weights the expert matmuls have read so far (each call: its selected
        experts' prepared bytes) and what their dense equivalent (every expert, every call)
        would have read: a mixture of experts' traffic, for ``dynalm bench``."""
        experts = [p for p in self._prepared.values() if isinstance(p, Experts)]
        dense = sum(e.calls * e.shape[0] * e.expert_bytes for e in experts)
        return sum(e.bytes_read for e in experts), dense

    @property
    def greedy_on_device(self) -> bool:
        """Whether ``run(greedy=True)`` can bring back tokens instead of logits."""
        return self.binder.device_greedy

    def _run_profiled(self, profile: dict[str, float]) -> None:
        clock = time.perf_counter
        for op, call in zip(self.ops, self._calls, strict=True):
            t0 = clock()
            call()
            profile[op] = profile.get(op, 0.0) + clock() - t0
