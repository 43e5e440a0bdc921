"""The mixture-of-experts kernels: ``moe_route`` against torch, ``expert_matmul`` (grouped by
expert over each expert's ``QuantMatmul``; ``safe``: the numpy reference) against an fp64
dense reference, and bitwise against each expert's own matmul of the same rows in ``exact``
and ``auto``; ``moe_combine`` against its sum.

Budgets as in test_matmul.py: ``safe`` and ``exact`` each output within the rounding of an
fp32 sum of its K products (`tolerances.sum_bound`; the bias one rounding more); ``auto``
(int8 activations per 32-block) an rms error < 1e-2 of the output rms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_matmul import activations, weights

from dynalm.core import cpu_ops
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.experts import Experts, ExpertScratch
from dynalm.core.matmul import ActivationScratch, QuantMatmul
from dynalm.core.quant import dequantize
from tolerances import sum_bound

E, N, K = 12, 40, 256  # experts of [N, K]


def experts_of(mode: str, ggml_type: T) -> tuple[Experts, np.ndarray]:
    """The experts as a ``CpuDevice`` in ``mode`` prepares them (through the executor: each
    when first routed to), and their GGUF rows ``[E, N, row bytes]``."""
    raw = weights(ggml_type, E * N, K).reshape(E, N, -1)
    device, scratch = CpuDevice(mode), ActivationScratch()
    nbytes = device.prepared_bytes(ggml_type, (N, K), "matmul")
    prepare = lambda e: device.matmul(raw[e], ggml_type, (N, K), scratch=scratch)  # noqa: E731
    return Experts((E, N, K), nbytes, prepare, ExpertScratch()), raw


def random_route(t_rows: int, top_k: int, seed: int) -> np.ndarray:
    """Each row: ``top_k`` distinct experts, then random weights."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((t_rows, E)), axis=1)[:, :top_k]
    return np.concatenate([ids, rng.random((t_rows, top_k))], axis=1).astype(np.float32)


def expert_matmul(mode: str, experts: Experts, x, route, bias) -> np.ndarray:
    """As the CPU binder runs it: the numpy reference in ``safe``, grouped by expert else."""
    out = np.full((len(x), route.shape[1] // 2 * N), np.nan, np.float32)
    if mode == "safe":
        cpu_ops.expert_matmul(out, x, route, experts.matmul, experts.shape, bias)
    else:
        experts(x, route, out, bias)
    return out


CASES = [(t, k, shared) for t in (1, 5, 64) for k in (1, 2, 8) for shared in (True, False)]


@pytest.mark.parametrize("mode", ["safe", "exact", "auto"])
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q8_0, T.F32], ids=lambda t: t.name)
def test_expert_matmul_matches_the_dense_reference(ggml_type: T, mode: str) -> None:
    experts, raw = experts_of(mode, ggml_type)
    dense = dequantize(raw, ggml_type, K).astype(np.float64)  # [E, N, K]
    bias = np.random.default_rng(0).standard_normal((E, N)).astype(np.float32)
    int8 = mode == "auto" and ggml_type != T.F32  # F32 runs exact's kernel in auto
    for t_rows, top_k, shared in CASES:
        # x: one row for every slot (gate/up), or a row per slot (down)
        x = activations(t_rows, K if shared else top_k * K)
        route = random_route(t_rows, top_k, t_rows + top_k)
        out = expert_matmul(mode, experts, x, route, bias).reshape(t_rows, top_k, N)
        ids = route[:, :top_k].astype(int)
        xs = x.reshape(t_rows, -1, K).astype(np.float64)  # [T, 1 or top_k, K]
        products = np.einsum("tjk,tjnk->tjn", xs, dense[ids])
        ref = products + bias[ids]
        if int8:
            rms = np.sqrt(np.mean(ref**2))
            assert np.sqrt(np.mean((out - ref) ** 2)) < 1e-2 * rms, (t_rows, top_k, shared)
        else:
            bound = sum_bound(K + 8, np.einsum("tjk,tjnk->tjn", np.abs(xs), np.abs(dense[ids])))
            bound += sum_bound(2, np.abs(ref))
            assert (np.abs(out - ref) <= bound).all(), (t_rows, top_k, shared)


def test_experts_without_a_jit_kernel_run_one_at_a_time() -> None:
    """F32 experts of K = 40 (not whole 32-blocks: numpy's matmul, no JIT kernel to group)
    take the per-expert loop, gathered and scattered as the grouped job's rows are."""
    k = 40
    raw = weights(T.F32, E * N, k).reshape(E, N, -1)
    device = CpuDevice("exact")
    assert device.matmul_kernel(T.F32, (N, k)).kind == "numpy"
    prepare = lambda e: device.matmul(raw[e], T.F32, (N, k))  # noqa: E731
    experts = Experts((E, N, k), 4 * N * k, prepare, ExpertScratch())
    dense = raw.view(np.float32).astype(np.float64)  # [E, N, k]
    bias = np.random.default_rng(1).standard_normal((E, N)).astype(np.float32)
    for t_rows, top_k, shared in CASES:
        x = activations(t_rows, k if shared else top_k * k)
        route = random_route(t_rows, top_k, t_rows + top_k)
        out = expert_matmul("exact", experts, x, route, bias).reshape(t_rows, top_k, N)
        ids = route[:, :top_k].astype(int)
        xs = x.reshape(t_rows, -1, k).astype(np.float64)
        ref = np.einsum("tjk,tjnk->tjn", xs, dense[ids]) + bias[ids]
        bound = sum_bound(k + 8, np.einsum("tjk,tjnk->tjn", np.abs(xs), np.abs(dense[ids])))
        bound += sum_bound(2, np.abs(ref))
        assert (np.abs(out - ref) <= bound).all(), (t_rows, top_k, shared)


@pytest.mark.parametrize("mode", ["exact", "auto"])
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q8_0, T.F32], ids=lambda t: t.name)
def test_each_slot_is_bitwise_its_expert_s_own_matmul(ggml_type: T, mode: str) -> None:
    """Grouped or alone, a row's product is the same bits: the property every matmul has
    (rows do not depend on the batch), so exact and auto keep it across backends and twins."""
    experts, raw = experts_of(mode, ggml_type)
    kernel = CpuDevice(mode).matmul_kernel(ggml_type, (N, K)).kind.removeprefix("jit-")
    for t_rows, top_k, shared in CASES:
        x = activations(t_rows, K if shared else top_k * K)
        route = random_route(t_rows, top_k, 7 * t_rows + top_k)
        out = expert_matmul(mode, experts, x, route, None).reshape(t_rows * top_k, N)
        rows = x.reshape(t_rows, -1, K)[:, [0] * top_k if shared else slice(None)]
        rows = rows.reshape(t_rows * top_k, K)
        ids = route[:, :top_k].astype(int).ravel()
        for e in np.unique(ids):
            alone = QuantMatmul(raw[e], ggml_type, K, mode=kernel)
            assert np.array_equal(alone(np.ascontiguousarray(rows[ids == e])), out[ids == e])


def test_only_selected_experts_are_prepared_and_their_bytes_counted() -> None:
    experts, _ = experts_of("exact", T.Q4_0)
    route = random_route(3, 2, 0)
    route[:, :2] = [[4, 9], [9, 4], [4, 1]]
    expert_matmul("exact", experts, activations(3, K), route, None)
    expert_matmul("exact", experts, activations(3, K)[:1], route[:1], None)
    assert experts.prepared == [1, 4, 9]
    assert experts.calls == 2 and experts.bytes_read == (3 + 2) * experts.expert_bytes
    assert experts.expert_bytes == N * (K // 32) * 18  # Q4_0's 18 bytes per 32 values


def test_a_route_naming_no_expert_is_refused() -> None:
    experts, _ = experts_of("exact", T.Q8_0)
    route = random_route(2, 2, 0)
    route[1, 1] = E
    with pytest.raises(ValueError, match=f"a route names expert {E} of {E}"):
        expert_matmul("exact", experts, activations(2, K), route, None)


def torch_route(logits: np.ndarray, top_k: int, gating: int, normalize: bool, scale: float):
    """transformers' routers: probabilities, their top k, renormalised, scaled."""
    x = torch.from_numpy(logits)
    probs = torch.softmax(x, dim=-1) if gating == 1 else torch.sigmoid(x)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.numpy(), (weights * scale).numpy()


@pytest.mark.parametrize("gating", [1, 2])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_moe_route_matches_torch(gating: int, normalize: bool, top_k: int) -> None:
    logits = 3 * np.random.default_rng(top_k).standard_normal((37, 64)).astype(np.float32)
    scale = 2.5 if normalize else 1.0
    out = np.full((37, 2 * top_k), np.nan, np.float32)
    cpu_ops.moe_route(out, logits, top_k, gating, normalize, scale)
    ids, expected = torch_route(logits, top_k, gating, normalize, scale)
    assert np.array_equal(out[:, :top_k], ids)  # exact integers, highest first
    # a few fp32 roundings of values <= scale (exp, a sum of 64, a division or two)
    np.testing.assert_allclose(out[:, top_k:], expected, rtol=0, atol=sum_bound(64, scale))


def test_moe_route_ties_go_to_the_lower_id_and_mixtral_is_softmax_normalised() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    out = np.empty((2, 6), np.float32)
    cpu_ops.moe_route(out, logits, 3, 1, False, 1.0)
    assert out[:, :3].tolist() == [[1, 2, 4], [0, 1, 2]]
    # Mixtral / gpt-oss: the top k of the logits, then a softmax over those k
    logits = np.random.default_rng(3).standard_normal((9, 8)).astype(np.float32)
    out = np.empty((9, 4), np.float32)
    cpu_ops.moe_route(out, logits, 2, 1, True, 1.0)
    top = torch.topk(torch.from_numpy(logits), 2, dim=-1)
    assert np.array_equal(out[:, :2], top.indices.numpy())
    np.testing.assert_allclose(out[:, 2:], torch.softmax(top.values, -1).numpy(), atol=1e-6)


def test_moe_combine_sums_the_weighted_slots() -> None:
    rng = np.random.default_rng(5)
    y = rng.standard_normal((6, 3 * 16)).astype(np.float32)
    route = random_route(6, 3, 5)
    out = np.empty((6, 16), np.float32)
    cpu_ops.moe_combine(out, y, route)
    terms = route[:, 3:, None].astype(np.float64) * y.reshape(6, 3, 16)
    assert (np.abs(out - terms.sum(axis=1)) <= sum_bound(3 + 1, np.abs(terms).sum(1))).all()
