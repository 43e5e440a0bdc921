"""Binding a DynaIR graph to a device's kernels (``base.Binder``), one binder per device kind.

``BINDERS`` maps a device's kind (``Device.name``) to the module and class that bind a graph
on it; a new device is its binder module and one line here (and its ``core`` device class).
The modules are imported when a device of their kind first binds a graph.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynalm.core.device import Device
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
