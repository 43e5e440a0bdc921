"""Execution planning: liveness analysis assigns every activation a buffer slot.

Activations are ``[rows, width]`` fp32 values. A slot is reused once the value in
it is dead, and only by a value of the same width (its size class), so the plan
needs a few buffers per width, allocated once for the largest step; a step
then allocates no activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynalm.ir.graph import Graph


@dataclass(frozen=True)
class Plan:
    slot_of: dict[int, int]  # value id -> slot index
    slot_widths: list[int]  # slot index -> row width (elements)

    def describe(self) -> str:
        return f"{len(self.slot_widths)} buffers for {len(self.slot_of)} values"


def plan_buffers(graph: Graph) -> Plan:
    last_use: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for arg in node.args:
            last_use[arg.id] = i
    for out in graph.outputs.values():
        last_use[out.id] = len(graph.nodes)

    slot_of: dict[int, int] = {}
    widths: list[int] = []
    free: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        width = node.out.type.row_width
        pool = free.setdefault(width, [])
        if pool:
            slot = pool.pop()
        else:
            slot = len(widths)
            widths.append(width)
        slot_of[node.out.id] = slot
        # Free after allocating the output: an op never writes over its own input.
        for arg in set(node.args):
            if last_use.get(arg.id) == i and arg.id in slot_of:
                free[arg.type.row_width].append(slot_of[arg.id])
        if node.out.id not in last_use:  # value never used: free immediately
            free[width].append(slot)
    return Plan(slot_of, widths)
