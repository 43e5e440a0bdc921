"""Execution planning: liveness analysis assigns every activation a buffer slot.

Activations are ``[rows, width]`` fp32 values. A slot is reused once the value in
it is dead, and only by a value of the same width (its size class), so the plan
needs a few buffers per width, allocated once for the largest step; a step
then allocates no activation memory. A view (a ``split`` marked ``view``) gets no slot:
it reads its source's buffer, which stays live until the view's last reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynalm.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class Plan:
    slot_of: dict[int, int]  # value id -> slot index
    slot_widths: list[int]  # slot index -> row width (elements)

    def describe(self) -> str:
        return f"{len(self.slot_widths)} buffers for {len(self.slot_of)} values"


def plan_buffers(graph: Graph) -> Plan:
    source: dict[int, Value] = {}  # view id -> the value owning its buffer
    for node in graph.nodes:
        if node.op == "split" and node.attrs.get("view"):
            arg = node.args[0]
            source[node.out.id] = source.get(arg.id, arg)

    def owners(node: Node) -> set[Value]:
        return {source.get(arg.id, arg) for arg in node.args}

    last_use: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for arg in owners(node):
            last_use[arg.id] = i
    for out in graph.outputs.values():
        last_use[out.id] = len(graph.nodes)

    slot_of: dict[int, int] = {}
    widths: list[int] = []
    free: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        if node.out.id in source:
            continue
        width = node.out.type.row_width
        pool = free.setdefault(width, [])
        if pool:
            slot = pool.pop()
        else:
            slot = len(widths)
            widths.append(width)
        slot_of[node.out.id] = slot
        # Free after allocating the output: an op never writes over its own input.
        for arg in owners(node):
            if last_use.get(arg.id) == i and arg.id in slot_of:
                free[arg.type.row_width].append(slot_of[arg.id])
        if node.out.id not in last_use:  # value never used: free immediately
            free[width].append(slot)
    return Plan(slot_of, widths)
