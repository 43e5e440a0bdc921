"""The Device interface: the CPU's op table covers the IR, ``--backend auto|cpu|gpu`` picks a
device from the registry (a GPU only when one is available and holds the model), and the
KV pages' bytes belong to the device while the page pool keeps the accounting."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dynalm.core import devices
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.devices import DeviceKind, select_device
from dynalm.core.kv_storage import HostKVStorage, KVGeometry
from dynalm.errors import DeviceUnavailable
from dynalm.ir.lower.cpu import CpuBinder
from dynalm.ir.ops import OPS
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.show import describe_system

MIB = 2**20


def test_the_cpu_op_table_covers_every_op_of_the_ir():
    assert set(CpuBinder.OP_TABLE) == set(OPS)


def test_an_op_missing_from_a_device_table_is_named():
    class Partial(CpuBinder):
        OP_TABLE = {op: f for op, f in CpuBinder.OP_TABLE.items() if op != "mul"}

    binder = Partial(CpuDevice("safe", threads=1), graph=None, prepare=None)
    with pytest.raises(NotImplementedError, match="the cpu device has no kernel for op 'mul'"):
        binder.bind("mul", [])


def test_auto_falls_back_to_the_cpu_with_the_reason(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="dynalm.core.devices"):
        device = select_device("auto", "safe", 1)
    assert device.name == "cpu"
    cuda = devices.GPU_KINDS[0]
    assert f"backend auto: using the CPU (cuda: {cuda.unavailable()}" in caplog.text


def test_gpu_fails_with_every_kind_s_reason_on_one_line():
    with pytest.raises(DeviceUnavailable) as e:
        select_device("gpu", "safe", 1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("--gpu: no usable GPU (cuda: ")
    assert all(f"{kind.name}: " in message for kind in devices.GPU_KINDS)


class _FakeGpu(CpuDevice):
    name = "fake"


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> DeviceKind:
    """A GPU kind that is present, with 1 GiB of memory (a CPU device under another name)."""
    kind = DeviceKind("fake", "Fake", lambda: None, lambda: 1024 * MIB, _FakeGpu)
    monkeypatch.setattr(devices, "GPU_KINDS", [kind])
    return kind


def test_auto_takes_a_gpu_that_holds_the_model(fake_gpu: DeviceKind):
    assert select_device("auto", "exact", 1, need=lambda device: 512 * MIB).name == "fake"
    assert select_device("gpu", "exact", 1, need=lambda device: 512 * MIB).name == "fake"
    assert select_device("cpu", "exact", 1, need=lambda device: 512 * MIB).name == "cpu"
    # safe is the CPU's fp32 numpy reference: never a GPU's
    assert select_device("auto", "safe", 1, need=lambda device: 512 * MIB).name == "cpu"


def test_auto_leaves_a_gpu_too_small_for_the_model(
    fake_gpu: DeviceKind, caplog: pytest.LogCaptureFixture
):
    asked = []
    need = lambda device: asked.append(device.mode) or 2048 * MIB  # noqa: E731
    with caplog.at_level(logging.INFO, logger="dynalm.core.devices"):
        assert select_device("auto", "exact", 1, need=need).name == "cpu"
    assert asked == ["exact"]  # the plan of the mode asked for
    assert "needs 2048 MiB of device memory" in caplog.text and "has 1024 MiB" in caplog.text
    with pytest.raises(DeviceUnavailable, match="fake: the model needs 2048 MiB"):
        select_device("gpu", "exact", 1, need=need)


def test_a_present_gpu_without_a_device_class_is_not_chosen(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(devices, "GPU_KINDS", [DeviceKind("fake", "Fake", lambda: None)])
    with pytest.raises(DeviceUnavailable, match="no Fake device class is built"):
        select_device("gpu", "safe", 1)


def test_show_system_lists_the_devices(fake_gpu: DeviceKind):
    text = describe_system()
    assert "  cpu     available: kernels " in text
    assert "  fake    available" in text


def test_the_kv_bytes_are_the_device_s():
    asked = []

    class Recording(CpuDevice):
        def kv_storage(self, geometry: KVGeometry) -> HostKVStorage:
            asked.append(geometry)
            return super().kv_storage(geometry)

    pool = PagePool(2, 3, 64, n_pages=4, page_size=16, dtype="q8_0", n_seqs=2,
                    device=Recording("safe", threads=1))  # fmt: skip
    assert asked == [KVGeometry(2, 3, 64, 4, 16, "q8_0", 2)]
    assert pool.recent == pool.storage.recent == 32 and pool.n_free_recent == 2
    # the pool's own arrays: the refcounts, and lists of free page and buffer ids
    arrays = [v for v in vars(pool).values() if isinstance(v, np.ndarray)]
    assert len(arrays) == 1 and arrays[0] is pool.refcount
    lists = [v for v in vars(pool).values() if isinstance(v, list)]
    assert all(isinstance(i, int) for ids in lists for i in ids)
    assert pool.nbytes == pool.storage.nbytes > 0
