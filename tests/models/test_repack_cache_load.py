"""The repack cache on real loads: SmolLM2's first load writes every JIT weight, the second
maps them all (no repack, no GGUF row read) and computes bitwise the same; a GGUF changed
in place (same path, same size) never hits its old entries; a file changed moments before
it is opened is not cached at all."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from dynalm.core import memory
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.matmul import QuantMatmul
from dynalm.models import loader
from dynalm.models.loader import load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, repeat_penalty=1.0)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNALM_REPACK_CACHE", str(tmp_path / "repack"))
    return tmp_path / "repack"


def bind(path: Path, mode: str = "auto") -> tuple[Engine, CpuDevice]:
    device = CpuDevice(mode)
    engine = Engine(load_model(path), device, EngineConfig(ctx=128, max_num_seqs=1))
    return engine, device


def matmuls(engine: Engine) -> dict[str, QuantMatmul]:
    prepared = engine.executor._prepared.items()
    return {name: mm for (name, _), mm in prepared if isinstance(mm, QuantMatmul)}


def outputs(engine: Engine) -> dict[str, np.ndarray]:
    """Every JIT matmul of the model on the same activations (a decode row and a batch)."""
    out = {}
    for name, mm in matmuls(engine).items():
        x = np.random.default_rng(mm.n_cols).standard_normal((5, mm.n_cols), np.float32)
        out[name] = np.concatenate([mm(x[:1]), mm(x)])
    return out


def generate(engine: Engine, prompt: list[int]) -> list[int]:
    engine.add_request("r", prompt, GREEDY, stop_ids=frozenset())
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.token_ids
    return got


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_second_load_maps_and_matches(smollm2_gguf: Path, cache_dir: Path, mode: str):
    prompt = list(range(100, 140))
    cold, cold_device = bind(smollm2_gguf, mode)
    n = len(matmuls(cold))
    assert n and cold_device.repacked == n and cold_device.mapped == 0
    assert len(list(cache_dir.glob("*.bin"))) == n
    want, want_tokens = outputs(cold), generate(cold, prompt)
    del cold

    warm, warm_device = bind(smollm2_gguf, mode)
    assert (warm_device.repacked, warm_device.mapped) == (0, n)
    assert warm_device.repack_seconds == 0.0
    got = outputs(warm)
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert generate(warm, prompt) == want_tokens
    # the weights are the cache files' copies (read into huge pages, or their read-only
    # pages mapped), not the GGUF's
    in_memory = memory.huge_pages()
    assert all(mm._weights.flags.writeable == in_memory for mm in matmuls(warm).values())


def test_changed_file_at_the_same_path_misses(
    smollm2_gguf: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(loader, "RACY_SECONDS", 0.05)
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, path)
    time.sleep(0.1)
    first, device = bind(path)
    n = device.repacked
    name = "blk.3.ffn_down.weight"
    info = first.executor.weights.gguf.tensors[name]
    before = matmuls(first)[name]
    other = first.executor.weights.gguf.tensors["blk.4.ffn_down.weight"]
    rows = 10 * info.nbytes // info.shape[0]
    with open(path, "r+b") as f:  # same size, other weights: 10 rows of another layer's
        f.seek(other.offset)
        data = f.read(rows)
        f.seek(info.offset)
        f.write(data)
    time.sleep(0.1)
    changed, device = bind(path)
    assert (device.repacked, device.mapped) == (n, 0), "no entry of the old file is used"
    assert len(list(cache_dir.glob("*.bin"))) == n, "the changed file took the old slots"
    monkeypatch.setenv("DYNALM_REPACK_CACHE", "off")
    uncached, _ = bind(path)
    x = np.random.default_rng(0).standard_normal((3, info.shape[1]), np.float32)
    want = matmuls(uncached)[name](x)
    assert np.array_equal(matmuls(changed)[name](x), want)
    assert not np.array_equal(before(x), want)


def test_a_file_changed_just_before_opening_is_not_cached(
    smollm2_gguf: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Its timestamps might not move if it is written again within the same tick."""
    monkeypatch.setattr(loader, "RACY_SECONDS", 3600.0)
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, path)
    _, device = bind(path)
    _, device = bind(path)
    assert device.mapped == 0 and device.repacked > 0
    assert not list(cache_dir.glob("*.bin"))
