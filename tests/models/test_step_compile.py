"""When SmolLM2's kernels are lowered: binding the model lowers none; each step of a new
shape lowers what it calls and has not lowered, in one ``backends.lower_all`` batch
(compiled concurrently), never one kernel at a time; a decode step lowers no GEMM tile;
no compile thread is left afterwards."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from dynalm.core.cpu_device import CpuDevice
from dynalm.kernel import backends, jit
from dynalm.models.loader import load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.generator import Generator, generator_config


def test_each_step_lowers_its_kernels_together(smollm2_gguf: Path, monkeypatch):
    batches: list[list[backends.Request]] = []
    lower_all = backends.lower_all

    def recorded(requests):
        requests = list(requests)
        batches.append(requests)
        return lower_all(requests)

    monkeypatch.setattr(backends, "lower_all", recorded)
    one_at_a_time = []
    compile_module = jit.compile_module
    monkeypatch.setattr(
        jit, "compile_module", lambda *a: one_at_a_time.append(a) or compile_module(*a)
    )
    device = CpuDevice("auto")
    device.backend = dataclasses.replace(device.backend, _lowered={})  # nothing lowered yet
    gen = Generator(Engine(load_model(smollm2_gguf), device, generator_config(64)))
    assert batches == []  # binding lowers nothing
    # prefill: T = 24, whole groups of every tile (3-row wide AVX2 tile, 4-row tile, 8 lanes;
    # no rest row left to a GEMV, so the decode step's GEMVs are new)
    gen.forward(list(range(1, 25)))
    gen.forward([30])  # decode: T = 1
    gen.forward([31])  # the same shape again: nothing new
    # (one at a time only the repack cache's checksum, once per JIT cache: loads need it)
    alone = [a for a in one_at_a_time if "repack_checksum" not in a[0].splitlines()[0]]
    assert len(batches) == 2 and alone == []
    prefill, decode = ({s.get("mr") for b, p, s in batch if p.name == "mm"} for batch in batches)
    # every tile a 24-row step uses is the GEMM tile of its bucket, the quantiser (no mr)
    # and the GEMVs of the output (one logit row); a decode step adds only GEMVs
    assert None in prefill and max(prefill - {None}) > 1 and decode == {1}
    kinds = {p.name for _, p, _ in batches[0]}
    assert {"attn", "ew_rms_norm", "ew_rope", "ew_add", "ew_gated"} <= kinds
    assert not [t for t in threading.enumerate() if t.name.startswith("dynalm-compile")]
