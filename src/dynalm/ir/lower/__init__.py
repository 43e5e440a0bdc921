"""Binding a DynaIR graph to a device's kernels (``base.Binder``), one binder per device kind.

``BINDERS`` maps a device's kind (``Device.name``) to the module and class that bind a graph
on it; a new device is its binder module and one line here (and its ``core`` device class).
The modules are imported when a device of their kind first binds a graph.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dynalm.core.quant import tensor_type

if TYPE_CHECKING:
    from dynalm.core.device import Device
    from dynalm.ir.graph import Graph
    from dynalm.ir.lower.base import Binder

BINDERS = {
    "cpu": "dynalm.ir.lower.cpu:CpuBinder",
    "cuda": "dynalm.ir.lower.cuda:CudaBinder",
}


def binder_class(device: Device) -> type[Binder]:
    """The binder of ``device``'s kind."""
    where = BINDERS.get(device.name)
    if where is None:
        raise NotImplementedError(f"no binder for the {device.name} device (ir.lower.BINDERS)")
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


def unsupported(device: Device, graph: Graph) -> str | None:
    """Why ``device`` cannot run ``graph``: an op its binder has no entry for, or weights its
    kernel for that op does not take (``Device.supports``); None when it can. Asked before
    any weight is read (``--backend auto`` then takes the CPU)."""
    table = binder_class(device).OP_TABLE
    for node in graph.nodes:
        if node.attrs.get("view"):
            continue  # a view of its source's columns: no call
        if node.op not in table:
            return f"no kernel for op '{node.op}'"
        weights = tuple((tensor_type(w.type.dtype), w.type.shape) for w in node.weights)
        if not device.supports(node.op, weights, node.attrs):  # type: ignore[arg-type]
            what = [f"{w.name}: {w.type}" for w in node.weights]
            what = what or [f"{k} {v}" for k, v in node.attrs.items() if k != "scale"]
            return f"no {node.op} kernel for {', '.join(what)}"
    return None
