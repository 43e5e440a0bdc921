"""The memory plan (``runtime/memory_plan.py``) against what a run really holds, its refusal
before anything large is read, and where it is printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, dynalm
from test_memory import resident_bytes_of

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine import memory_plan
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.memory_plan import Available, NotEnoughMemory, plan_memory

# A child process: plan, then a run that fills what the plan counts. The prompt fills the
# KV pool (ctx - 8 tokens, then 8 generated) and, scored with prompt_logprobs, every row of
# the step's buffers (the logits too: 512-token chunks); then its peak RSS less its shared
# libraries' pages (memory_plan.peak_rss).
CHILD = """
import json, sys
from dynalm.core.devices import select_device
from dynalm.models.loader import load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.memory_plan import peak_rss, plan_memory
from dynalm.runtime.engine.sampling import SamplingParams

path, mode, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load_model(path)
device = select_device("cpu", mode, None)
config = EngineConfig(ctx=ctx, max_num_seqs=1, max_num_batched_tokens=512)
plan = plan_memory(model, config, device)
engine = Engine(model, device, config)
ids = [(i * 7919) % (model.hparams.n_vocab - 100) + 100 for i in range(ctx - 8)]
params = SamplingParams(max_tokens=8, temperature=0).validate()
engine.add_request("r", ids, params, prompt_logprobs=1)
while engine.has_unfinished():
    engine.step()
print(json.dumps({"plan": plan.total, "kv": plan.kv, "pool": engine.pool.nbytes,
                  "peak": peak_rss()}))
"""


def test_plan_within_10_percent_of_peak_rss(smollm2_gguf: Path) -> None:
    src = str(Path(memory_plan.__file__).parents[2])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(smollm2_gguf), "auto", "1024"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": src},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout)
    print(f"memory plan {m['plan'] / 2**20:.1f} MiB, peak RSS {m['peak'] / 2**20:.1f} MiB")
    assert m["kv"] == m["pool"]  # the plan's KV is the pool the engine allocated
    assert abs(m["plan"] - m["peak"]) <= 0.10 * m["peak"], m


def test_kv_figure_is_the_engines_pool(smollm2_gguf: Path) -> None:
    model = load_model(smollm2_gguf.resolve())
    for config in (
        EngineConfig(ctx=64, max_num_seqs=3, kv_cache_dtype="q8_0"),  # + recent buffers
        EngineConfig(ctx=100, max_num_seqs=2, kv_cache_memory=5 << 20),
    ):
        engine = Engine(model, CpuDevice("safe"), config)
        assert engine.memory_plan.kv == engine.pool.nbytes
        assert engine.memory_plan.kv_tokens == engine.pool.n_pages * config.page_size


def test_not_enough_memory_is_refused_before_loading(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, auto = load_model(smollm2_gguf.resolve()), CpuDevice("auto")
    config = EngineConfig(ctx=8192, max_num_seqs=16)
    plan = plan_memory(model, config, auto)
    # room for everything but half the KV pool: fewer sequences, a shorter context or q8_0
    room = plan.need - plan.kv // 2
    monkeypatch.setattr(memory_plan, "available_memory", lambda: Available(room, "test cgroup"))
    with pytest.raises(NotEnoughMemory) as e:
        Engine(model, auto, config)
    message = str(e.value)
    assert "\n" not in message and message.startswith("not enough memory: memory plan ")
    assert "(test cgroup)" in message and "short by " in message
    # the default pool is capped at 2 GiB, so q8_0 would only hold more tokens in as much
    assert "--kv-cache-dtype q8_0" not in message
    advice = message.split("; try ")[1].split(" or ")
    assert [a.split()[0] for a in advice] == ["--ctx", "--max-num-seqs"]
    ctx, seqs = (int(a.split()[1]) for a in advice)  # each the most that fits, alone
    assert plan_memory(model, EngineConfig(ctx=ctx, max_num_seqs=16), auto).fits
    assert not plan_memory(model, EngineConfig(ctx=ctx + 16, max_num_seqs=16), auto).fits
    assert plan_memory(model, EngineConfig(ctx=8192, max_num_seqs=seqs), auto).fits
    assert not plan_memory(model, EngineConfig(ctx=8192, max_num_seqs=seqs + 1), auto).fits
    # under the cap, q8_0 halves the pool
    config = EngineConfig(ctx=4096, max_num_seqs=8)
    plan = plan_memory(model, config, auto)
    room = plan.need - plan.kv // 3
    monkeypatch.setattr(memory_plan, "available_memory", lambda: Available(room, "test cgroup"))
    with pytest.raises(NotEnoughMemory, match=r"or --kv-cache-dtype q8_0$"):
        plan_memory(model, config, auto).check()
    # nothing large was read: the weights were never touched (the metadata's pages, mapped
    # in up to 2 MiB at a time where a freshly written file sits in large folios)
    resident = resident_bytes_of(smollm2_gguf.resolve())
    assert resident < 0.02 * smollm2_gguf.stat().st_size + 2**21

    monkeypatch.setattr(memory_plan, "available_memory", lambda: Available(1 << 20, "tiny"))
    with pytest.raises(NotEnoughMemory, match="the weights alone do not fit"):
        plan_memory(model, EngineConfig(ctx=16, max_num_seqs=1), auto).check()
    with pytest.raises(NotEnoughMemory, match=r"try --mode auto"):
        plan_memory(model, EngineConfig(ctx=16, max_num_seqs=1), CpuDevice("safe")).check()


def test_available_memory_reads_this_machine() -> None:
    available = memory_plan.available_memory()
    assert available.bytes > 0 and available.source


def test_show_and_verbose_print_the_plan(smollm2_gguf: Path) -> None:
    result = dynalm("show", str(smollm2_gguf), "--ctx", "2048", "--max-num-seqs", "4")
    assert result.returncode == 0, result.stderr
    assert "memory plan (fits):" in result.stdout
    for row in ("weights", "KV pool", "activations", "runtime", "total", "available"):
        assert f"    {row}" in result.stdout
    assert "8192 tokens of f16: --ctx 2048, --max-num-seqs 4" in result.stdout

    result = dynalm("run", str(smollm2_gguf), "hi", "--max-tokens", "2", "--ctx", "256",
                    "--verbose")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "memory plan " in result.stderr and "(256 tokens f16: --ctx 256 x" in result.stderr

    result = dynalm("show", str(smollm2_gguf), "--ctx", "100000")
    assert_one_line_error(result, "--ctx 100000 is more than the 8192 tokens")


def test_cgroup_limit_beats_memavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = memory_plan._cgroup_dirs()  # this process's, then each mount's root
    assert real[-1][0] == "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    assert ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
            "cgroup v2 memory.max") in real  # fmt: skip
    (tmp_path / "memory.max").write_text("max\n")  # v2 without a limit: not a figure
    (tmp_path / "limit").write_text(f"{300 << 20}\n")
    (tmp_path / "usage").write_text(f"{100 << 20}\n")
    files = [(str(tmp_path / "memory.max"), str(tmp_path / "none"), "cgroup v2 memory.max")]
    monkeypatch.setattr(memory_plan, "_cgroup_dirs", lambda: files)
    assert memory_plan.available_memory().source == "MemAvailable"
    files[0] = (str(tmp_path / "limit"), str(tmp_path / "usage"), "cgroup v1 memory limit")
    assert memory_plan.available_memory() == Available(200 << 20, "cgroup v1 memory limit")
