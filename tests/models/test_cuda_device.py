"""The CUDA device (preview) end to end without a GPU: SmolLM2 runs through
``core.cuda_device`` and the driver API against ``cuda_emulator.EmulatedLibcuda``, whose
kernels are the NVPTX backend's host twin. Its logits must equal the CPU's generic backend
bitwise (the twin's arithmetic: same 8 lanes, same integer sums, same float order) and the
host's best backend within two fp32 passes' rounding; the engine's greedy tokens are the
CPU's; the KV pages live in (emulated) device memory; ``--backend auto|gpu`` choose it.

On a machine with an NVIDIA GPU, ``benchmarks/gpu_check.py --fidelity`` runs the same
comparison on the real device.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_engine import GREEDY, encode, run, tokens

from cuda_emulator import ILLEGAL_ADDRESS, INVALID_PTX, EmulatedLibcuda
from dynalm.core import cuda_driver, devices
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.cuda_device import CudaDevice, CudaKVStorage
from dynalm.core.devices import select_device
from dynalm.core.kv_storage import AttentionBatch, HostKVStorage, KVGeometry
from dynalm.errors import DeviceUnavailable, InvalidRequest, ModelFormatError
from dynalm.ir.executor import Executor
from dynalm.ir.lower import unsupported
from dynalm.ir.lower.cuda import CudaBinder
from dynalm.models.loader import LoadedModel, load_model, model_graph
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.spec_decode.drafters import NgramDrafter
from dynalm.show import describe_system
from tolerances import forward_bound, logit_scale
from workload import TEXTS, assert_no_leak


@pytest.fixture
def gpu() -> EmulatedLibcuda:
    return EmulatedLibcuda()


def cuda(gpu: EmulatedLibcuda, mode: str = "auto") -> CudaDevice:
    return CudaDevice(mode, driver=cuda_driver.Driver(gpu))


def forward(
    model: LoadedModel,
    device: object,
    ids: list[int],
    profile: bool = False,
    max_tokens: int = 64,
    start: int = 0,
) -> np.ndarray:
    """Logits of a prefill of ``ids`` at every position (from position ``start``: the
    earlier ones' KV is left zero), then of one decode step (f32 KV, so that only the two
    devices' arithmetic differs); ``profile``: op by op, timed; ``max_tokens``: what the
    executor is sized for at first."""
    hp = model.hparams
    ex = Executor(model.graph, device, model.weights, max_tokens=max_tokens)
    ex.profile = {} if profile else None
    n = len(ids)
    n_pages = -(-(start + n + 1) // 16)
    pool = PagePool(hp.n_layers, hp.n_kv_heads, hp.head_dim, n_pages, 16, "f32", device=device)
    pages = pool.allocate(n_pages)
    n += start

    def step(tokens: list[int], start: int, rows: np.ndarray) -> np.ndarray:
        end = start + len(tokens)
        batch = AttentionBatch(
            pool.storage, np.array([0, len(tokens)]), np.array([end]), [np.array(pages)],
            pool.slots(pages, start, end),
        )  # fmt: skip
        return ex.run(np.array(tokens), np.arange(start, end), rows, batch).copy()

    prefill = step(ids, start, np.arange(len(ids)))
    return np.concatenate([prefill, step([int(prefill[-1].argmax())], n, np.array([0]))])


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_logits_equal_the_cpu(model, gpu, mode, monkeypatch):
    ids = encode(model, "The capital of France is")
    got = forward(model, cuda(gpu, mode), ids)
    assert gpu.launches > 0 and gpu.allocated > 50 << 20  # weights, KV, activations
    if mode == "auto":  # run op by op (bench --profile): the same logits come back
        np.testing.assert_array_equal(forward(model, cuda(gpu, mode), ids, profile=True), got)
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, forward(model, CpuDevice(mode), ids))
    monkeypatch.delenv("DYNALM_ISA")
    best = forward(model, CpuDevice(mode), ids)
    hp = model.hparams
    bound = forward_bound(hp.n_layers, max(hp.d_ff, hp.d_model), logit_scale(best))
    assert (np.abs(got - best) <= bound).all()
    assert (got.argmax(-1) == best.argmax(-1)).all()


def test_buffers_and_rope_tables_grow_on_the_device(model, gpu, monkeypatch):
    """A step longer than the executor was sized for (its buffers, scratch and argument
    blocks reallocated), at positions past the rope tables' first 256 (they grow, and every
    op is bound again to the new device copies)."""
    ids = encode(model, TEXTS[1])
    monkeypatch.setenv("DYNALM_ISA", "generic")  # the twin's arithmetic: bitwise
    want = forward(model, CpuDevice("auto"), ids, max_tokens=4, start=290)
    got = forward(model, cuda(gpu), ids, max_tokens=4, start=290)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_engine_tokens_equal_the_cpu(model, device, gpu, kv_dtype):
    """Four greedy requests batched, with a shared prefix cached: the CPU's tokens, the
    device picking them (only token ids come back) except in steps with drafts. q8_0
    also drafts n-grams (fixed draft length): rejected drafts roll the device's recent f16
    buffers back."""
    spec = kv_dtype == "q8_0"
    config = EngineConfig(ctx=128, kv_cache_dtype=kv_dtype, max_num_seqs=4, adaptive_draft=False)
    prompts = [encode(model, t) for t in TEXTS[:3]] + [encode(model, TEXTS[0] + " the")]
    want = [tokens(o) for o in run(Engine(model, device, config), prompts)]
    engine = Engine(model, cuda(gpu), config, NgramDrafter() if spec else None)
    assert isinstance(engine.pool.storage, CudaKVStorage)
    steps, executor_run = [], engine.executor.run  # greedy: tokens picked on the device
    engine.executor.run = lambda *a, **kw: steps.append(kw["greedy"]) or executor_run(*a, **kw)
    assert [tokens(o) for o in run(engine, prompts)] == want
    assert any(steps) and (not spec or not all(steps))  # steps with drafts need logits
    drafted = engine.spec_stats
    assert not spec or drafted.num_draft_tokens > drafted.num_accepted_tokens > 0
    again = run(engine, prompts[:1])[0]  # its prefix from the cache, on the device
    assert again[-1].cached_tokens > 0 and tokens(again) == want[0]
    assert all(len(t) == GREEDY.max_tokens for t in want)
    assert_no_leak(engine)


def test_kv_pages_live_in_device_memory(gpu):
    """Copy-on-write and the recent-row saves of speculative decoding move device bytes as
    the host storage moves its arrays."""
    geometry = KVGeometry(2, 3, 64, n_pages=4, page_size=16, dtype="q8_0", n_seqs=2)
    device, host = cuda(gpu).kv_storage(geometry), HostKVStorage(geometry)
    before = gpu.allocated
    assert device.nbytes == host.nbytes and device.page_nbytes == host.page_nbytes
    rng = np.random.default_rng(0)
    context = cuda(gpu).context
    for name, (layers, shape, dtype) in geometry.arrays().items():
        for layer in range(layers):
            data = rng.integers(-100, 100, shape).astype(dtype)
            getattr(host, name)[layer][...] = data
            context.copy_in(getattr(device, name)[layer], data)
    host.copy_page(1, 3)
    device.copy_page(1, 3)
    rows = np.array([5, 40])
    saved = device.save_recent(rows)
    np.testing.assert_array_equal(np.stack(saved), np.stack(host.save_recent(rows)))
    for name, (layers, shape, dtype) in geometry.arrays().items():
        for layer in range(layers):
            out = context.copy_out(getattr(device, name)[layer], np.empty(shape, dtype))
            np.testing.assert_array_equal(out, getattr(host, name)[layer], err_msg=name)
    device.restore_recent(rows[::-1], saved)  # put back crosswise: rows swapped
    k = context.copy_out(device.k_recent[1], np.empty(geometry.recent_shape, np.float16))
    np.testing.assert_array_equal(k[[40, 5]], host.k_recent[1][[5, 40]])
    del device
    assert gpu.allocated < before  # freed with the storage


def test_backend_auto_and_gpu_choose_the_cuda_device(gpu, monkeypatch):
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    assert isinstance(select_device("auto", "auto"), CudaDevice)
    assert isinstance(select_device("gpu", "exact"), CudaDevice)
    assert isinstance(select_device("cpu", "auto"), CpuDevice)
    assert isinstance(select_device("auto", "safe"), CpuDevice)  # the CPU's reference
    assert isinstance(select_device("auto", "auto", need=lambda device: 9 << 30), CpuDevice)
    with pytest.raises(DeviceUnavailable, match=r"cuda: the model needs 9216 MiB .* has 8192"):
        select_device("gpu", "auto", need=lambda device: 9 << 30)
    assert "  cuda    available" in describe_system()
    ptx_load = gpu.cuModuleLoadDataEx
    gpu.cuModuleLoadDataEx = lambda *args: INVALID_PTX  # a driver too old for the PTX
    assert isinstance(select_device("auto", "auto"), CpuDevice)  # its self-check failed
    with pytest.raises(DeviceUnavailable, match="self-check: .* CUDA_ERROR_INVALID_PTX"):
        select_device("gpu", "auto")
    gpu.cuModuleLoadDataEx = ptx_load
    gpu.cc = (7, 5)
    with pytest.raises(DeviceUnavailable, match="is sm_75; the preview's PTX needs sm_80"):
        select_device("gpu", "auto")
    with pytest.raises(InvalidRequest, match="--mode safe .* --cpu"):
        cuda(gpu, "safe")


def test_what_the_preview_cannot_run_is_named(model, gpu, monkeypatch):
    device = cuda(gpu)
    binder = Executor(model.graph, device, model.weights, max_tokens=4).binder
    monkeypatch.delitem(type(binder).OP_TABLE, "split")  # a device whose table lacks an op
    with pytest.raises(NotImplementedError, match="the cuda device has no kernel for op 'split'"):
        binder.bind("split", [])
    with pytest.raises(InvalidRequest, match="no matmul kernel for IQ2_XXS .* --cpu"):
        device.matmul(np.zeros((4, 66), np.uint8), 16, (4, 256))
    assert "cuda" in [kind.name for kind in devices.GPU_KINDS]


def test_nan_block_scales_are_refused_by_the_cuda_repack_naming_the_tensor(
    smollm2_gguf, gpu, tmp_path
):
    """Issue 31: the CPU's repack refuses a weight whose block scales are NaN or infinite
    (the JIT kernels swallow them, and the model answers fluently); the CUDA device repacked
    its weights itself, unchecked. Both go through `QuantMatmul.checked_repack` now."""
    path = tmp_path / "nan-scales.gguf"
    path.write_bytes(smollm2_gguf.read_bytes())
    name = "blk.0.ffn_down.weight"
    info = next(t for t in gguf.GGUFReader(smollm2_gguf).tensors if t.name == name)
    assert info.tensor_type == GGMLQuantizationType.Q4_1  # d at byte 0 of 20
    data = np.memmap(path, np.uint8, "r+", offset=info.data_offset, shape=(info.n_bytes,))
    data.reshape(-1, 20)[5:9, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    data.flush()
    del data
    model = load_model(path)
    with pytest.raises(ModelFormatError) as e:
        forward(model, cuda(gpu), encode(model, "Hi"))
    assert str(e.value) == (
        f"tensor {name}: q4_1 block 5 of row 0 has a non-finite scale (nan; 4 such fields)"
    )
    rows = np.zeros((8, 20 * 8), np.uint8)  # the device's own entry: a Q4_1 [8, 256]
    rows[2, 20 * 7 : 20 * 7 + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    with pytest.raises(ModelFormatError, match=r"^q4_1 block 7 of row 2 has a non-finite"):
        cuda(gpu).matmul(rows, GGMLQuantizationType.Q4_1, (8, 256))


def test_auto_runs_on_the_cpu_what_the_gpu_cannot(model, gpu, monkeypatch, caplog):
    """``--backend auto`` asks the device before any weight is read: a graph with an op the
    device has no kernel for (here its table without ``swiglu``; SmolLM2's splits are all
    views) runs on the CPU, the reason logged; ``--gpu`` fails with it.
    Every op of the table has a kernel now, the unfused graph's ``silu`` and ``mul`` too;
    what remains is a weight format without a JIT matmul."""
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    assert unsupported(cuda(gpu), model.graph) is None
    assert unsupported(cuda(gpu), model_graph(model.gguf, model.hparams)) is None
    why = lambda device: unsupported(device, model.graph)  # noqa: E731
    table = dict(CudaBinder.OP_TABLE)
    del table["swiglu"]
    monkeypatch.setattr(CudaBinder, "OP_TABLE", table)
    with caplog.at_level(logging.INFO, logger="dynalm.core.devices"):
        assert isinstance(select_device("auto", "auto", unsupported=why), CpuDevice)
    assert "using the CPU (cuda: no kernel for op 'swiglu';" in caplog.text
    with pytest.raises(DeviceUnavailable, match="cuda: no kernel for op 'swiglu';"):
        select_device("gpu", "auto", unsupported=why)
    device = cuda(gpu)  # weights its kernels do not take: a format without a JIT matmul
    assert not device.supports("matmul", ((16, (4, 256)),))
    q4_1 = int(GGMLQuantizationType.Q4_1)
    assert device.supports("matmul", ((q4_1, (4, 256)), (0, (4,))))  # a bias: its kernel
    assert device.supports("matmul_add", ((q4_1, (4, 256)),))
    # the 16-value table formats: PTX has their lookup (``lookup16``'s compare-and-select)
    for table in (
        GGMLQuantizationType.IQ4_NL,
        GGMLQuantizationType.IQ4_XS,
        GGMLQuantizationType.MXFP4,
    ):
        assert device.supports("matmul", ((int(table), (4, 256)),))


def test_the_emulator_refuses_host_memory_in_a_launch(gpu):
    """What makes the tests above mean something: a host address reaching a kernel fails."""
    device = cuda(gpu)
    from dynalm.kernel import elementwise_programs as programs

    out = device.buffer(4, 8)
    host = np.ones((4, 8), np.float32)  # not mirrored: no device copy
    fn, entry = device.function(programs.PROGRAMS["add"], {}, "add")
    block = device.alloc(32)
    words = np.array([out.size, device.address(out), host.ctypes.data, device.address(out)])
    device.context.copy_in(block, words)
    with pytest.raises(cuda_driver.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as e:
        device.context.launch(fn, entry.grid(out.size), [block.ptr, out.size])
    assert e.value.code == ILLEGAL_ADDRESS and "word 2" in gpu.error


def test_gpu_check_runs_its_kernels_on_the_emulator():
    """``benchmarks/gpu_check.py``, what a GPU machine runs, keeps working."""
    import gpu_check

    assert gpu_check.kernels(emulate=True) == 0


def test_dynalm_run_gpu_answers_as_the_cpu(smollm2_gguf, gpu, monkeypatch):
    """`dynalm run MODEL PROMPT --gpu --verbose`, the CLI in this process (the emulated
    driver in place of libcuda): the CPU's greedy answer, and --verbose names the device."""
    from typer.testing import CliRunner

    from dynalm.cli import app

    args = ["run", str(smollm2_gguf), "The three primary colors are", "--temperature", "0"]
    args += ["--max-tokens", "12", "--verbose"]
    cpu = CliRunner().invoke(app, [*args, "--cpu"])
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    on_gpu = CliRunner().invoke(app, [*args, "--gpu"])
    assert cpu.exit_code == on_gpu.exit_code == 0, on_gpu.output
    assert on_gpu.stdout == cpu.stdout and len(cpu.stdout.split()) > 3
    assert "cuda:0 DynaLM emulated GPU (sm_80" in on_gpu.stderr
