"""The executor: binds a planned graph to a device and its weights once, then runs steps.

Binding resolves every node to a kernel closure with its weights already prepared
by the device (dequantised, repacked or memory-mapped, as the mode wants) and
its output assigned to a planned buffer. A step then only slices the buffers to
the step's token count and calls the closures in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dynalm.core import cpu_ops
from dynalm.core.cpu_ops import AttentionBatch
from dynalm.core.device import CpuDevice
from dynalm.ir.graph import Graph, Node
from dynalm.ir.planner import Plan, plan_buffers


class WeightSource(Protocol):
    def raw(self, name: str) -> np.ndarray: ...
    def tensor_type(self, name: str) -> int: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...


@dataclass
class _Step:
    """Everything a bound op needs at run time."""

    kernel: Callable[..., None]  # kernel(out, *args, ctx)
    out: int  # value id
    args: tuple[int, ...]  # value ids
    out_rows: str  # "T" or "S": which count sizes the output


@dataclass
class StepContext:
    tokens: np.ndarray
    positions: np.ndarray
    batch: AttentionBatch


class Executor:
    def __init__(
        self, graph: Graph, device: CpuDevice, weights: WeightSource, max_tokens: int = 512
    ):
        self.graph = graph
        self.device = device
        self.plan: Plan = plan_buffers(graph)
        self._weights = weights
        self._prepared: dict[tuple[str, str], object] = {}
        self._rope_tables: dict[tuple, cpu_ops.RopeTable] = {}
        self._buffers: list[np.ndarray] = []
        self._reserve(max_tokens)
        self._steps = [self._bind(node) for node in graph.nodes]
        self._inputs = {name: v.id for name, v in graph.inputs.items()}
        self._logits = graph.outputs["logits"].id

    def _reserve(self, rows: int) -> None:
        self._capacity = rows
        self._buffers = [np.empty((rows, w), np.float32) for w in self.plan.slot_widths]

    # -- binding -------------------------------------------------------------------
    def _prepare(self, name: str, use: str) -> object:
        """A weight prepared for one use (matmul, embedding, vector); done once."""
        key = (name, use)
        if key not in self._prepared:
            raw = self._weights.raw(name)
            qtype = self._weights.tensor_type(name)
            shape = self._weights.tensor_shape(name)
            prepare = {
                "matmul": self.device.matmul,
                "embedding": self.device.embedding,
                "vector": self.device.vector,
            }[use]
            self._prepared[key] = prepare(raw, qtype, shape)
        return self._prepared[key]

    def _bind(self, node: Node) -> _Step:
        a = node.attrs
        w = [wt.name for wt in node.weights]
        op = node.op
        if op == "embed":
            lookup = self._prepare(w[0], "embedding")
            kernel = lambda out, ids, ctx: lookup(ids, out)  # noqa: E731
        elif op == "matmul":
            mm = self._prepare(w[0], "matmul")
            bias = self._prepare(w[1], "vector") if len(w) > 1 else None

            def kernel(out, x, ctx, mm=mm, bias=bias):
                mm(x, out)
                if bias is not None:
                    out += bias
        elif op == "rms_norm":
            weight = self._prepare(w[0], "vector")
            kernel = lambda out, x, ctx: cpu_ops.rms_norm(out, x, weight, a["eps"])  # noqa: E731
        elif op == "head_rms_norm":
            weight = self._prepare(w[0], "vector")
            kernel = lambda out, x, ctx: cpu_ops.head_rms_norm(  # noqa: E731
                out, x, weight, a["eps"], a["head_dim"]
            )
        elif op == "rope":
            factors = self._prepare(w[0], "vector") if w else None
            key = (a["rope_dim"], a["base"], a["scale"], w[0] if w else None)
            if key not in self._rope_tables:
                self._rope_tables[key] = cpu_ops.RopeTable(
                    a["rope_dim"], a["base"], a["scale"], factors
                )
            table = self._rope_tables[key]
            kernel = lambda out, x, pos, ctx: cpu_ops.rope(  # noqa: E731
                out, x, pos, table, a["head_dim"], a["rope_dim"], a["neox"]
            )
        elif op == "attention":
            kernel = lambda out, q, k, v, ctx: cpu_ops.attention(  # noqa: E731
                out,
                q,
                k,
                v,
                ctx.positions,
                ctx.batch,
                a["layer"],
                a["n_heads"],
                a["n_kv_heads"],
                a["head_dim"],
                a["scale"],
                a["window"],
            )
        elif op == "add":
            kernel = lambda out, x, y, ctx: np.add(x, y, out=out)  # noqa: E731
        elif op == "mul":
            kernel = lambda out, x, y, ctx: np.multiply(x, y, out=out)  # noqa: E731
        elif op == "scale":
            factor = np.float32(a["factor"])
            kernel = lambda out, x, ctx: np.multiply(x, factor, out=out)  # noqa: E731
        elif op == "silu":
            kernel = lambda out, x, ctx: cpu_ops.silu(out, x)  # noqa: E731
        elif op == "gelu_tanh":
            kernel = lambda out, x, ctx: cpu_ops.gelu_tanh(out, x)  # noqa: E731
        elif op == "select_rows":
            kernel = lambda out, x, rows, ctx: np.take(x, rows, axis=0, out=out)  # noqa: E731
        else:
            raise NotImplementedError(f"the CPU device has no kernel for op '{op}'")
        rows = node.out.type.shape[0]
        return _Step(kernel, node.out.id, tuple(v.id for v in node.args), str(rows))

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
        env: dict[int, np.ndarray] = {
            self._inputs["tokens"]: tokens,
            self._inputs["positions"]: positions,
            self._inputs["logit_rows"]: logit_rows,
        }
        ctx = StepContext(tokens, positions, batch)
        slot_of, buffers = self.plan.slot_of, self._buffers
        for step in self._steps:
            rows = n_tokens if step.out_rows == "T" else n_logits
            out = buffers[slot_of[step.out]][:rows]
            step.kernel(out, *(env[i] for i in step.args), ctx)
            env[step.out] = out
        return env[self._logits]
