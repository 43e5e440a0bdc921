"""Binding a graph to a device: the interface every device's binder implements.

The executor plans buffers and views, prepares weights, groups split runs and keeps the
submissions of small step shapes; a ``Binder`` turns each node into a zero-argument call
over those buffers through its op table (``OP_TABLE``: op name -> a method taking the node,
or for ``split`` the run of consecutive splits of one value; the methods of
``BIND_METHODS`` the binder defines) and a step's calls into one submission. What it reads
of the executor is small and explicit: the graph, ``prepare`` (a weight prepared for one
use, once) and, while it binds, the ``Buffers``. The device it binds for knows buffers,
kernels and memory, never graph nodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from dynalm.core.cpu_ops import RopeTable
from dynalm.ir.ops import GATES, OPS

if TYPE_CHECKING:
    from dynalm.core.device import Device
    from dynalm.core.kv_storage import AttentionBatch
    from dynalm.ir.graph import Graph, Node

Call = Callable[[], None]  # one bound op of a step
# Each op of the IR -> the name of the binder method that binds it (ops of one kind share
# one); a device's binder binds the ops whose methods it defines.
BIND_METHODS: dict[str, str] = {op: f"_{op}" for op in OPS} | {
    "matmul_add": "_matmul",
    "rms_norm": "_norm",
    "head_rms_norm": "_norm",
    "silu": "_activation",
    "gelu_tanh": "_activation",
    "tanh": "_activation",
    **dict.fromkeys(GATES, "_gated"),
}
Prepare = Callable[[str, str], object]  # (weight name, use) -> the weight as the device keeps it


@dataclass
class Buffers:
    """The executor's planned buffers, as a binder reads them while it binds every node."""

    capacity: int  # rows of every buffer: the most tokens a step may have
    full: dict[int, np.ndarray]  # value id -> its buffer at full capacity (a view: its columns)
    views: list[np.ndarray]  # the step's views, sliced to its token count: read when a call runs
    view_of: dict[int, int]  # value id -> its index in ``views``


class Binder(ABC):
    """One graph's ops bound on one device (see the module docstring)."""

    OP_TABLE: ClassVar[Mapping[str, Callable[..., Call]]]
    cached_rows: ClassVar[int] = 0  # submissions of steps up to this many tokens are kept
    # The most positions a sequence holds (the engine's --ctx; 0: not known): a rope with
    # long-context factors reads them when this passes its orig_ctx, as llama.cpp does
    context: int = 0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "OP_TABLE" not in cls.__dict__:
            methods = BIND_METHODS.items()
            cls.OP_TABLE = {op: getattr(cls, m) for op, m in methods if hasattr(cls, m)}

    def __init__(self, device: Device, graph: Graph, prepare: Prepare) -> None:
        self.device, self.graph, self.prepare = device, graph, prepare
        self.buffers: Buffers  # from ``begin_bind``
        # rope's cos/sin tables, computed on the host (and grown on demand) for every device
        self._rope_tables: dict[tuple, RopeTable] = {}
        self._rope_positions = 256  # positions the rope tables cover

    def bind(self, op: str, nodes: list[Node]) -> Call:
        """``nodes[0]`` (a run of ``split`` nodes of one value: all of them) as one call."""
        impl = self.OP_TABLE.get(op)
        if impl is None:
            raise NotImplementedError(f"the {self.device.name} device has no kernel for op '{op}'")
        return impl(self, nodes if op == "split" else nodes[0])

    def prepare_matmul(
        self, raw: object, ggml_type: int, shape: tuple[int, int], **how: object
    ) -> object:
        """A matmul weight for this graph (the CPU adds its shared activation scratch)."""
        return self.device.matmul(raw, ggml_type, shape, **how)

    @abstractmethod
    def reserve(self, rows: int, widest: int) -> None:
        """Size per-step scratch for ``rows`` tokens of matmul inputs up to ``widest``
        (before binding)."""

    def begin_bind(self, buffers: Buffers) -> None:
        """Binding of every node over ``buffers`` starts (again)."""
        self.buffers = buffers

    def end_bind(self) -> None:  # noqa: B027 - nothing to do unless a device gathers state
        """Every node is bound."""

    def rope_table(self, node: Node) -> RopeTable:
        """The cos/sin table of a rope node's settings, covering the positions bound for."""
        a, w = node.attrs, [wt.name for wt in node.weights]
        if len(w) == 2:  # LongRoPE: the long-context factors past the trained context
            w = w[1:] if self.context > a["orig_ctx"] else w[:1]
        attn_factor = a.get("attn_factor", 1.0)
        yarn_attrs = ("ext_factor", "orig_ctx", "beta_fast", "beta_slow")
        yarn = tuple(a[n] for n in yarn_attrs) if "ext_factor" in a else None
        key = (a["rope_dim"], a["base"], a["scale"], w[0] if w else None, attn_factor, yarn)
        if key not in self._rope_tables:
            factors = self.prepare(w[0], "vector") if w else None
            how = (factors, attn_factor, yarn)
            table = RopeTable(a["rope_dim"], a["base"], a["scale"], *how)
            self._rope_tables[key] = table
        table = self._rope_tables[key]
        table.ensure(self._rope_positions)
        return table

    def cover_positions(self, need: int) -> bool:
        """Positions up to ``need`` come next; True when that needs binding again (the
        kernels hold the rope tables' addresses)."""
        if need > self._rope_positions and self._rope_tables:
            self._rope_positions = max(need, 2 * self._rope_positions)
            return True
        return False

    def stale(self) -> bool:
        """Whether the compiled steps must be compiled again (their calls would now run
        differently); checked before each step."""
        return False

    @abstractmethod
    def begin_step(self, batch: AttentionBatch, positions: np.ndarray) -> None:
        """A step over ``batch`` starts (the attention layout)."""

    @abstractmethod
    def resize(self, n_tokens: int, n_logits: int) -> None:
        """The step shape changed (the kernels' row counts)."""

    @abstractmethod
    def submission(self, calls: list[Call]) -> list[Call]:
        """The step's calls as few submissions as the device can (kernels lowered first)."""

    # whether ``end_step(greedy=True)`` returns the greedy tokens computed on the device
    device_greedy = False

    def end_step(self, greedy: bool = False) -> np.ndarray | None:  # noqa: B027
        """The step's calls have run: its logits must be readable on the host when this
        returns (a GPU copies them back), or with ``greedy`` (only where
        ``device_greedy``) only each logit row's first argmax, returned (int64, -1 where
        the row holds a NaN or its max is infinite), and the logits stay on the device.
        Nothing to do where the host holds the logits."""
        return None
