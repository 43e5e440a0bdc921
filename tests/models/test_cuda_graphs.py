"""A step on the CUDA device is one CUDA graph launch (issue 30 part 2), on the emulator.

Between the upload of a step's inputs (token ids, positions, logit rows, the attention
layout) and the download of its logits there is device work only: the embedding lookup and
``select_rows`` are row-gather kernels. The step's launches are captured once per step
shape (``cuStreamBeginCapture`` .. ``cuGraphInstantiate``) and replayed by one
``cuGraphLaunch``, with what changes written into the device memory the kernels read. The
driver calls of each step are counted through a wrapper around the emulated driver.
"""

from __future__ import annotations

import gc
import json
from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from tiny_models import SPECS, VOCAB, reference_model, write_gguf

from cuda_emulator import CAPTURE_UNSUPPORTED, EmulatedLibcuda
from dynalm.core import cuda_driver
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.cuda_device import CudaDevice
from dynalm.core.kv_storage import AttentionBatch
from dynalm.core.matmul import CACHED_ROWS
from dynalm.ir.executor import Executor
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.kv_cache import PagePool

IDS = [5, 17, 3, 99, 42, 7, 61, 8]


class CountingLibcuda:
    """The emulated driver, each ``cu*`` call counted in ``calls``."""

    def __init__(self, lib: EmulatedLibcuda) -> None:
        self.lib, self.calls = lib, Counter[str]()

    def __getattr__(self, name: str) -> object:
        function = getattr(self.lib, name)

        def counted(*args: object) -> int:
            self.calls[name] += 1
            if name == "cuMemcpyDtoH_v2":
                self.calls["bytes down"] += args[2].value  # (dst, src, size_t nbytes)
            return function(*args)

        return counted

    def take(self) -> Counter[str]:
        """The calls since the last ``take``."""
        calls, self.calls = self.calls, Counter()
        return calls


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("graphs") / "llama-q8_0.gguf"
    spec = SPECS["llama"]
    write_gguf(reference_model(spec), spec, path, GGMLQuantizationType.Q8_0)
    return load_model(path)


def greedy(
    model: LoadedModel,
    device: object,
    steps: int,
    after_step=None,  # noqa: ANN001
    on_device: bool = False,
    prompt: list[int] = IDS,
) -> np.ndarray:
    """Logits of a prefill of ``prompt`` and of ``steps`` greedy decode steps (one sequence,
    f32 KV); ``after_step(i)`` is called after step ``i`` (0: the prefill). ``on_device``:
    the steps' tokens instead, picked on the device (``Executor.run(greedy=True)``)."""
    hp = model.hparams
    ex = Executor(model.graph, device, model.weights, max_tokens=32)
    n_pages = -(-(len(prompt) + steps) // 16)
    pool = PagePool(hp.n_layers, hp.n_kv_heads, hp.head_dim, n_pages, 16, "f32", device=device)
    pages = pool.allocate(n_pages)
    tokens, start, out = list(prompt), 0, []
    for i in range(steps + 1):
        end = start + len(tokens)
        batch = AttentionBatch(
            pool.storage, np.array([0, len(tokens)]), np.array([end]), [np.array(pages)],
            pool.slots(pages, start, end),
        )  # fmt: skip
        rows = np.array([len(tokens) - 1])
        got = ex.run(np.array(tokens), np.arange(start, end), rows, batch, greedy=on_device)
        out.append(got.copy())
        if after_step is not None:
            after_step(i)
        tokens, start = [int(got[-1] if on_device else got[-1].argmax())], end
    return np.concatenate(out)


def test_a_decode_step_is_one_graph_launch(llama, monkeypatch):
    """After the first decode step captured its graph, each decode step of the same shape
    is the inputs' uploads, one ``cuGraphLaunch`` and the logits' download: no kernel
    launched from Python, no host work between. The replayed steps' logits equal the
    uncaptured device's (launches one by one) and the CPU generic backend's bitwise."""
    gpu = EmulatedLibcuda()
    counting = CountingLibcuda(gpu)
    device = CudaDevice("auto", driver=cuda_driver.Driver(counting))
    per_step: list[Counter[str]] = []
    counting.take()  # loading and binding
    got = greedy(llama, device, 4, lambda i: per_step.append(counting.take()))
    launches, kernels = device.submitted[1, 1]
    assert launches == 1 and kernels > 4 * llama.hparams.n_layers  # the whole step: one call
    # the first decode step: its shape's capture (launches recorded, none run), then a launch
    first = per_step[1]
    assert first["cuStreamBeginCapture_v2"] == first["cuStreamEndCapture"] == 1
    assert first["cuGraphInstantiateWithFlags"] == first["cuGraphLaunch"] == 1
    assert first["cuLaunchKernel"] == kernels
    # the inputs (token ids, positions, logit rows), the layout arena, the layout block
    replay = Counter({"cuMemcpyHtoD_v2": 5, "cuGraphLaunch": 1, "cuMemcpyDtoH_v2": 1})
    replay["bytes down"] = 4 * VOCAB  # one row of f32 logits
    assert per_step[2:] == [replay] * 3
    assert gpu.graph_launches == 5 and len(gpu.executables) == 2  # prefill's, decode's

    plain = CudaDevice("auto", driver=cuda_driver.Driver(EmulatedLibcuda()), graphs=False)
    np.testing.assert_array_equal(got, greedy(llama, plain, 4))
    assert plain.submitted[1, 1] == (kernels, kernels)
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, greedy(llama, CpuDevice("auto"), 4))


def test_decode_across_split_k_chunks_replays_one_graph(llama, monkeypatch):
    """Decode steps whose context grows from 761 to 770 keys, across a split-K chunk edge
    (768): the graph captured at three chunks replays at four (its attention runs a thread
    per item and chunk of the pool's longest context; threads past a context's chunks
    idle, and the merge reads each context's count), with the CPU generic backend's logits
    bitwise (whose decode steps split the same chunks over its threads). The first decode
    step grows the rope tables past the prompt's 760 positions: it captures anew."""
    prompt = [(7 * i + 3) % VOCAB for i in range(760)]
    counting = CountingLibcuda(EmulatedLibcuda())
    device = CudaDevice("auto", driver=cuda_driver.Driver(counting))
    per_step: list[Counter[str]] = []
    counting.take()
    got = greedy(llama, device, 10, lambda i: per_step.append(counting.take()), prompt=prompt)
    replay = Counter({"cuMemcpyHtoD_v2": 5, "cuGraphLaunch": 1, "cuMemcpyDtoH_v2": 1})
    replay["bytes down"] = 4 * VOCAB
    assert per_step[2:] == [replay] * 9  # no new capture, no launch from Python
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, greedy(llama, CpuDevice("auto"), 10, prompt=prompt))


def test_greedy_tokens_come_back_instead_of_logits(llama):
    """``run(greedy=True)``: the same graph (it ends with the argmax kernels: a partial
    per ``ARGMAX_CHUNK`` logits, a pick per row) then a download of one int64 token per
    row instead of the row's logits. The tokens are the logits' argmax; a CPU executor
    has no such path and says so."""
    counting = CountingLibcuda(EmulatedLibcuda())
    device = CudaDevice("auto", driver=cuda_driver.Driver(counting))
    want = greedy(llama, device, 3).argmax(axis=1)
    per_step: list[Counter[str]] = []
    counting.take()
    got = greedy(llama, device, 3, lambda i: per_step.append(counting.take()), on_device=True)
    np.testing.assert_array_equal(got, want)
    replay = Counter({"cuMemcpyHtoD_v2": 5, "cuGraphLaunch": 1, "cuMemcpyDtoH_v2": 1})
    replay["bytes down"] = 8  # one token id
    assert per_step[2:] == [replay] * 2  # (step 1 captured the decode shape's graph)
    ex = Executor(llama.graph, CpuDevice("auto"), llama.weights, max_tokens=8)
    assert not ex.greedy_on_device
    with pytest.raises(ValueError, match="CpuBinder has no greedy tokens on its device"):
        ex.run(np.array(IDS), np.arange(8), np.array([7]), None, greedy=True)  # type: ignore[arg-type]


def test_a_repeated_prefill_shape_replays_its_graph(llama):
    """Two prefills of one length in a row (another sequence's): one capture, two launches;
    the graphs are destroyed with the executor that holds them."""
    gpu = EmulatedLibcuda()
    counting = CountingLibcuda(gpu)
    device = CudaDevice("exact", driver=cuda_driver.Driver(counting))
    first = greedy(llama, device, 0)
    counting.take()
    hp = llama.hparams
    ex = Executor(llama.graph, device, llama.weights, max_tokens=32)
    pool = PagePool(hp.n_layers, hp.n_kv_heads, hp.head_dim, 2, 16, "f32", device=device)
    outs = []
    for pages in ([0], [1]):  # one sequence, then another of the same length
        batch = AttentionBatch(
            pool.storage, np.array([0, len(IDS)]), np.array([len(IDS)]), [np.array(pages)],
            pool.slots(pages, 0, len(IDS)),
        )  # fmt: skip
        rows = np.array([len(IDS) - 1])
        outs.append(ex.run(np.array(IDS), np.arange(len(IDS)), rows, batch).copy())
    calls = counting.take()
    assert calls["cuStreamBeginCapture_v2"] == 1 and calls["cuGraphLaunch"] == 2
    # the launches recorded once, none made directly
    assert calls["cuLaunchKernel"] == device.submitted[len(IDS), 1][1]
    np.testing.assert_array_equal(outs[0], first)
    np.testing.assert_array_equal(outs[1], first)
    del ex
    gc.collect()
    assert gpu.executables == {} and gpu.graphs == {}


def test_a_long_prefill_is_launched_not_captured(llama, monkeypatch):
    """A prefill of more rows than the executor keeps submissions for (``cached_rows``) runs
    once: its launches go one by one, no graph is captured for it, and its logits equal the
    CPU generic backend's bitwise (``auto``)."""
    gpu = EmulatedLibcuda()
    counting = CountingLibcuda(gpu)
    device = CudaDevice("auto", driver=cuda_driver.Driver(counting))
    hp = llama.hparams
    ids = np.arange(CACHED_ROWS + 2) * 7 % VOCAB
    n_pages = -(-len(ids) // 16)

    def prefill(dev: object) -> np.ndarray:
        ex = Executor(llama.graph, dev, llama.weights, max_tokens=len(ids))
        pool = PagePool(hp.n_layers, hp.n_kv_heads, hp.head_dim, n_pages, 16, "f32", device=dev)
        pages = pool.allocate(n_pages)
        batch = AttentionBatch(
            pool.storage, np.array([0, len(ids)]), np.array([len(ids)]), [np.array(pages)],
            pool.slots(pages, 0, len(ids)),
        )  # fmt: skip
        return ex.run(ids, np.arange(len(ids)), np.array([len(ids) - 1]), batch).copy()

    counting.take()
    got = prefill(device)
    calls = counting.take()
    launches, kernels = device.submitted[len(ids), 1]
    assert launches == kernels == calls["cuLaunchKernel"] > 4 * hp.n_layers
    assert calls["cuStreamBeginCapture_v2"] == calls["cuGraphLaunch"] == 0
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, prefill(CpuDevice("auto")))


def test_a_capture_refuses_host_work_and_ends():
    """A synchronous copy while the stream captures fails as CUDA's would (the reason a
    step's host parts had to become kernels); the capture is ended all the same, so the
    stream captures again afterwards."""
    gpu = EmulatedLibcuda()
    context = cuda_driver.Context(cuda_driver.Driver(gpu))
    owner = type("Owner", (), {})()
    stream = context.stream(owner)
    array = context.alloc(16)

    def copy() -> None:
        context.copy_in(array, np.zeros(4, np.float32))

    with pytest.raises(cuda_driver.CudaError, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED") as e:
        context.capture(stream, copy)
    assert e.value.code == CAPTURE_UNSUPPORTED
    assert gpu.error == "a synchronous copy while a stream captures"
    assert gpu.streams == {stream.value: None} and gpu.graphs == {}
    graph = context.capture(stream, lambda: None)  # an empty graph: it launches
    graph.launch(stream)
    assert gpu.graph_launches == 1
    del owner, graph
    gc.collect()
    assert gpu.streams == gpu.executables == {}


def test_bench_gpu_reports_launches_per_step(llama, monkeypatch):
    """``dynalm bench MODEL --gpu``: each step shape's driver launches (one) and kernels."""
    from dynalm.bench import bench_command, parse_tests

    gpu = EmulatedLibcuda()
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    kw = {"threads": 1, "repetitions": 1, "mode": "auto", "vs": None, "backend": "gpu"}
    out = json.loads(
        bench_command(llama.path, parse_tests("8", "4"), **kw, as_json=True, profile=False)
    )
    steps = {s["tokens"]: s for s in out["gpu_steps"]}
    assert steps[1]["launches"] == 1 and steps[1]["kernels"] > 4 * llama.hparams.n_layers
    assert all(s["launches"] == 1 for s in out["gpu_steps"])
    text = bench_command(llama.path, parse_tests("8", "4"), **kw, as_json=False, profile=False)
    assert f"1 token(s): 1 launch(es), {steps[1]['kernels']} kernels" in text
