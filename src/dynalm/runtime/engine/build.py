"""Assembling an engine for a start: ``build_engine``, what ``run``, ``serve``,
``perplexity`` and ``bench`` use.

The device is chosen for the model (``core.devices.select_device``: a GPU only where it can
run the model's graph and holds its memory plan), the memory plan made once for each device
asked (the chosen one's is the engine's; ``--verbose`` logs it), then the drafter and the
engine. Nothing large is read before the plan says the model fits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dynalm.core.device import Device
from dynalm.core.devices import select_device
from dynalm.ir.lower import unsupported
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.memory_plan import MemoryPlan, plan_memory
from dynalm.runtime.engine.spec_decode.drafters import build_drafter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What a start asks for: the model and its engine's configuration, where it runs
    (``--backend``, ``--mode``, ``--threads``, or a ``device`` already chosen: a second engine
    beside a first) and its drafter (``--draft`` model or ``--speculative`` kind)."""

    model: LoadedModel
    config: EngineConfig
    backend: str = "auto"
    mode: str = "auto"
    threads: int | None = None
    draft: LoadedModel | None = None
    speculative: str | None = None
    device: Device | None = None


def plan_engine(spec: EngineSpec) -> tuple[Device, MemoryPlan]:
    """The device ``spec`` runs on and its memory plan there, before anything large is read
    (a server checks the plan against its budget before it loads a model)."""
    model, config = spec.model, spec.config
    plans: dict[int, tuple[Device, MemoryPlan]] = {}  # by device (kept alive while asked)

    def plan(device: Device) -> MemoryPlan:
        if id(device) not in plans:
            plans[id(device)] = (device, plan_memory(model, config, device))
        return plans[id(device)][1]

    device = spec.device or select_device(
        spec.backend,
        spec.mode,
        spec.threads,
        need=lambda device: plan(device).device_bytes,
        unsupported=lambda device: unsupported(device, model.graph),
    )
    return device, plan(device)


def build_engine(spec: EngineSpec) -> Engine:
    """The engine ``spec`` asks for (see the module docstring)."""
    model, config = spec.model, spec.config
    device, memory_plan = plan_engine(spec)
    log.info("%s", memory_plan.line())
    drafter = build_drafter(
        spec.speculative,
        spec.draft,
        model,
        device,
        ctx=config.ctx,
        max_num_seqs=config.max_num_seqs,
        num_draft_tokens=config.num_draft_tokens,
    )
    return Engine(model, device, config, drafter, memory_plan)
