"""A mixture-of-experts FFN through the executor, from a synthetic GGUF whose expert tensors
are 3-D (``[E, N, K]`` in numpy order, as llama.cpp writes ``ffn_*_exps``): every mode
against an fp64 reference, the memory plan's bytes, and the mapped pages of experts no route
selects, which are never read."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from dynalm.core import cpu_ops
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.kv_storage import AttentionBatch, HostKVStorage, KVGeometry
from dynalm.core.quant import dequantize
from dynalm.ir.builder import GraphBuilder
from dynalm.ir.executor import Executor
from dynalm.ir.graph import Graph, TensorType
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.loader import GGUFWeights
from dynalm.runtime.engine.memory_plan import weight_bytes
from tolerances import sum_bound

VOCAB, D, F = 40, 256, 128  # tokens, model width, expert rows


def write_moe(path: Path, n_experts: int, qtype: T, router: np.ndarray | None = None) -> Path:
    """embedding f32 [VOCAB, D], router f32 [E, D], bias [E, F], experts ``qtype`` [E, F, D]
    (last: no other tensor's read maps their pages' neighbours)."""
    rng = np.random.default_rng(n_experts)
    w = GGUFWriter(str(path), "moe-test")
    w.add_tensor("embd", rng.uniform(0.5, 1.0, (VOCAB, D)).astype(np.float32))
    if router is None:
        router = rng.standard_normal((n_experts, D)).astype(np.float32)
    w.add_tensor("router", router)
    w.add_tensor("bias", rng.standard_normal((n_experts, F)).astype(np.float32))
    experts = rng.standard_normal((n_experts * F, D)).astype(np.float32)  # last in the file
    w.add_tensor("exps", quants.quantize(experts, qtype).reshape(n_experts, F, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def moe_graph(n_experts: int, qtype: str, top_k: int) -> Graph:
    """tokens -> embedding -> route (softmax, normalised) -> experts (+ bias) -> combined."""
    weights = {
        "embd": TensorType("f32", (VOCAB, D)),
        "router": TensorType("f32", (n_experts, D)),
        "exps": TensorType(qtype, (n_experts, F, D)),
        "bias": TensorType("f32", (n_experts, F)),
    }
    g = GraphBuilder("moe", weights)
    h = g.op("embed", g.input("tokens", "i32", ("T",)), weights=(g.weight("embd"),))
    g.input("positions", "i32", ("T",))
    g.input("logit_rows", "i32", ("S",))
    logits = g.op("matmul", h, weights=(g.weight("router"),))
    route = g.op("moe_route", logits, top_k=top_k, gating=1, normalize=True)
    y = g.op("expert_matmul", h, route, weights=(g.weight("exps"), g.weight("bias")))
    return g.finish(out=g.op("moe_combine", y, route))


def run(ex: Executor, tokens: np.ndarray) -> np.ndarray:
    """One step over ``tokens`` as one sequence (the graph has no attention: a bare pool)."""
    n = len(tokens)
    kv = HostKVStorage(KVGeometry(1, 1, 8, n_pages=-(-n // 16), page_size=16, dtype="f32"))
    batch = AttentionBatch(
        kv, np.array([0, n]), np.array([n]), [np.arange(kv.geometry.n_pages)], np.arange(n)
    )
    positions = np.arange(n)
    return ex.run(tokens, positions, positions[-1:], batch).copy()


def reference(path: Path, tokens: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """fp64 outputs and their error bound: each slot an fp32 sum of D products (+ a scale
    per block), then its weight; the route from the fp32 reference (its ids: far apart)."""
    f = GGUFFile(path)
    embd, router, bias = (dequantize(f.raw(n), f.tensors[n].ggml_type, f.tensors[n].shape[-1])
                          for n in ("embd", "router", "bias"))  # fmt: skip
    exps = dequantize(f.raw("exps"), f.tensors["exps"].ggml_type, D).astype(np.float64)
    h = embd[tokens]
    route = np.empty((len(tokens), 2 * top_k), np.float32)
    cpu_ops.moe_route(route, h @ router.T, top_k, 1, True, 1.0)
    ids, weights = route[:, :top_k].astype(int), route[:, top_k:].astype(np.float64)
    slots = np.einsum("tk,tjnk->tjn", h.astype(np.float64), exps[ids]) + bias[ids]
    bound = sum_bound(D + 8, np.einsum("tk,tjnk->tjn", np.abs(h), np.abs(exps[ids])))
    bound += sum_bound(top_k + 1, np.abs(slots))  # the bias and the weighted sum
    return np.einsum("tj,tjn->tn", weights, slots), np.einsum("tj,tjn->tn", weights, bound)


@pytest.mark.parametrize("mode", ["safe", "exact", "auto"])
def test_every_mode_matches_the_reference(tmp_path: Path, mode: str) -> None:
    path = write_moe(tmp_path / "moe.gguf", 8, T.Q8_0)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 13)
    ex = Executor(moe_graph(8, "q8_0", 2), CpuDevice(mode), GGUFWeights(GGUFFile(path)), 16)
    ref, bound = reference(path, tokens, 2)
    for n in (13, 1, 5):  # a new step shape each time: prefill, decode, a small batch
        out = run(ex, tokens[:n])
        if mode == "auto":  # activations rounded to int8 per 32-block (test_matmul.py)
            rms = np.sqrt(np.mean(ref[:n] ** 2))
            assert np.sqrt(np.mean((out - ref[:n]) ** 2)) < 1e-2 * rms
        else:
            assert (np.abs(out - ref[:n]) <= bound[:n]).all()


def test_the_memory_plan_counts_every_expert_once(tmp_path: Path) -> None:
    graph = moe_graph(8, "q8_0", 2)
    device = CpuDevice("exact")
    expert = device.prepared_bytes(int(T.Q8_0), (F, D), "matmul")
    rest = device.prepared_bytes(int(T.F32), (8, D), "matmul") + 4 * 8 * F  # router, bias
    assert weight_bytes(graph, device) == 8 * expert + rest
    assert weight_bytes(graph, CpuDevice("safe")) == 4 * (VOCAB * D + 8 * D + 8 * F * (D + 1))


def mapped_pages(array: np.ndarray) -> np.ndarray:
    """Per page under ``array``'s bytes: whether this process maps it (``/proc/self/pagemap``'s
    present bit), i.e. whether it was read through the map and not released since."""
    start = array.__array_interface__["data"][0]
    first, last = start // mmap.PAGESIZE, (start + array.nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * first)
        words = np.frombuffer(f.read(8 * (last - first + 1)), np.uint64)
    return (words >> np.uint64(63)).astype(bool)


class KeptWeights(GGUFWeights):
    """The file's weights with their pages never released, so that what was read stays mapped."""

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        pass


def test_experts_no_route_selects_are_never_read(tmp_path: Path) -> None:
    """A router that sends every token to experts 3 and 7 of 256: only those two are read
    (repacked), and the bytes a step reads are theirs. Pages are kept mapped once read, so the
    map shows what was read; the kernel maps a read page's neighbours too (fault-around, up to
    a 2 MiB folio), so experts within 2 MiB of a read one may show pages as well."""
    n_experts, chosen = 256, [3, 7]
    router = np.zeros((n_experts, D), np.float32)
    router[chosen] = [[1.0], [0.5]]  # embeddings in [0.5, 1): logits ~190 and ~95, others 0
    path = write_moe(tmp_path / "many.gguf", n_experts, T.Q8_0, router)
    gguf = GGUFFile(path)
    ex = Executor(moe_graph(n_experts, "q8_0", 2), CpuDevice("exact"), KeptWeights(gguf), 16)
    run(ex, np.arange(10))
    experts = ex.prepare("exps", "experts")
    assert experts.prepared == chosen
    assert experts.bytes_read == 2 * experts.expert_bytes and experts.calls == 1
    assert ex.expert_reads() == (2 * experts.expert_bytes, n_experts * experts.expert_bytes)
    raw = gguf.raw("exps")  # [E, F, row bytes], a view of the map
    read = [e for e in range(n_experts) if mapped_pages(raw[e]).any()]
    assert all(mapped_pages(raw[e]).all() for e in chosen)  # what was read shows
    near = 2 * 2**20 // raw[0].nbytes + 1  # experts a 2 MiB folio of a read one may cover
    assert max(read) <= max(chosen) + near, f"experts {read} of {n_experts} were read"
    assert len(read) < n_experts // 2, read
