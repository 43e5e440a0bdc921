"""The mixture-of-experts kernels: ``moe_route`` (the numpy reference and the native kernel)
against torch, ``expert_matmul`` (grouped by expert over each expert's ``QuantMatmul``;
``safe``: the numpy reference) against an fp64 dense reference, and bitwise against each
expert's own matmul of the same rows in ``exact`` and ``auto``; ``moe_combine`` against its
sum (the native kernel bitwise the reference); ``select_experts``, a one-token step's
experts named natively, preparing those not used before.

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

from dynalm.core import cpu_ops, elementwise, pool
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.experts import NATIVE_REREAD_BYTES, Experts, ExpertScratch
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch, QuantMatmul
from dynalm.core.quant import dequantize
from dynalm.kernel import backends
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


def moe_route(native: bool, logits: np.ndarray, *attrs: object) -> np.ndarray:
    """``moe_route``'s reference (numpy) or the native kernel the CPU binds."""
    out = np.full((len(logits), 2 * attrs[0]), np.nan, np.float32)
    if native:
        elementwise.moe_route(out, logits, *attrs)()
    else:
        cpu_ops.moe_route(out, logits, *attrs)
    return out


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
@pytest.mark.parametrize("gating", [1, 2])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_moe_route_matches_torch(gating: int, normalize: bool, top_k: int, native: bool) -> None:
    logits = 3 * np.random.default_rng(top_k).standard_normal((37, 64)).astype(np.float32)
    scale = 2.5 if normalize else 1.0
    out = moe_route(native, logits, top_k, gating, normalize, scale)
    ids, expected = torch_route(logits, top_k, gating, normalize, scale)
    assert np.array_equal(out[:, :top_k], ids)  # exact integers, highest first
    # a few fp32 roundings of values <= scale (exp, a sum of 64, a division or two)
    np.testing.assert_allclose(out[:, top_k:], expected, rtol=0, atol=sum_bound(64, scale))


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_moe_route_ties_go_to_the_lower_id_and_mixtral_is_softmax_normalised(
    native: bool,
) -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    out = moe_route(native, logits, 3, 1, False, 1.0)
    assert out[:, :3].tolist() == [[1, 2, 4], [0, 1, 2]]
    # ranked by the logits: probabilities that underflow alike (exp(-95), exp(-190))
    # still rank as their logits do
    logits = np.array([[0.0, 95.0, 190.0, 0.0]], np.float32)
    for gating in (1, 2):
        assert moe_route(native, logits, 2, gating, False, 1.0)[0, :2].tolist() == [2, 1]
    # Mixtral / gpt-oss: the top k of the logits, then a softmax over those k
    logits = np.random.default_rng(3).standard_normal((9, 8)).astype(np.float32)
    out = moe_route(native, logits, 2, 1, True, 1.0)
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


@pytest.mark.parametrize(("t_rows", "top_k", "n"), [(1, 8, 2048), (5, 2, 37), (3, 1, 16)])
def test_native_moe_combine_is_bitwise_the_reference(t_rows: int, top_k: int, n: int) -> None:
    """Each slot's product rounded, then added in slot order, as numpy does (no FMA),
    across the vector loop and its 1-lane tail (n = 37)."""
    y = np.random.default_rng(n).standard_normal((t_rows, top_k * n)).astype(np.float32)
    route = random_route(t_rows, top_k, n)
    want, got = np.empty((2, t_rows, n), np.float32)
    cpu_ops.moe_combine(want, y, route)
    elementwise.combine(got, y, route)()
    assert np.array_equal(got, want)


def test_select_experts_names_each_slot_s_weights_and_prepares_the_unknown() -> None:
    """A one-token route's experts' addresses into a column of argument blocks; where the
    table holds 0 the kernel calls back (the caller prepares that expert); the counter
    adds (experts, calls)."""
    table = np.arange(E, dtype=np.int64) * 4096 + 64
    table[[2, 7]] = 0
    asked: list[int] = []

    def prepare(e: int) -> int:
        asked.append(e)
        table[e] = 1_000_000 + e
        return int(table[e])

    miss = elementwise.MISS(prepare)
    blocks, counter = np.zeros((4, 9), np.int64), np.zeros(2, np.int64)
    route = np.array([[7, 0, 11, 2, 0.4, 0.3, 0.2, 0.1]], np.float32)
    select = elementwise.select_experts(blocks[:, 4], route, table, counter, miss)
    select()
    select()  # prepared now: no call back
    assert asked == [7, 2]
    assert blocks[:, 4].tolist() == [1_000_007, 64, 11 * 4096 + 64, 1_000_002]
    assert (blocks[:, [0, 1, 2, 3, 5, 6, 7, 8]] == 0).all()
    assert counter.tolist() == [8, 2]


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_a_small_step_s_native_records_are_bitwise_the_python_grouping(mode: str) -> None:
    """``step_records`` as a compiled step runs them (one native program), for shared x
    (gate/up) and a row per slot (down), with and without biases, one token and three
    (pairs sharing an expert among them): the same bits as the Python grouping of the same
    route, experts prepared on the way as the route asks."""
    bias = np.random.default_rng(2).standard_normal((E, N)).astype(np.float32)
    top_k = 3
    for t_rows, shared, b in ((1, True, None), (1, False, None), (3, True, bias), (3, False, bias)):
        experts, _ = experts_of(mode, T.Q4_K)
        experts.matmul(0)  # (a JIT expert: the grouped matmul exists)
        x = activations(t_rows, K if shared else top_k * K)
        out = np.full((t_rows, top_k * N), np.nan, np.float32)
        route = np.zeros((t_rows, 2 * top_k), np.float32)
        records, keep = experts.step_records(x, route, out, b, backends.select())
        program = pool.Program(records, 2)
        routes = [random_route(t_rows, top_k, seed) for seed in range(3)]
        routes[2][1:, :top_k] = routes[2][0, :top_k]  # every token to the same experts
        for r in routes:
            route[:] = r
            program()
            want = expert_matmul(mode, experts, x, route, b)
            assert np.array_equal(out, want), (t_rows, shared)
        used = {int(e) for r in routes for e in r[:, :top_k].ravel()}
        assert set(experts.prepared) == {0} | used
        assert experts.calls == 6  # 3 native, 3 in Python
        assert experts.bytes_read == 2 * 3 * t_rows * top_k * experts.expert_bytes - sum(
            (t_rows * top_k - len(np.unique(r[:, :top_k]))) * experts.expert_bytes for r in routes
        )


def test_an_expert_failing_to_prepare_inside_a_native_step_is_kept_for_the_step_s_end() -> None:
    """ctypes would print and drop what the call back raises: it is kept (the executor
    raises it when the step ends) and the expert's slot reads zeros meanwhile, no crash."""
    raw = weights(T.Q8_0, E * N, K).reshape(E, N, -1)
    device, scratch = CpuDevice("exact"), ActivationScratch()

    def prepare(e: int) -> object:
        if e == 5:
            raise ValueError("blk.0.ffn_up_exps.weight: expert 5's scales are NaN")
        return device.matmul(raw[e], T.Q8_0, (N, K), scratch=scratch)

    rows = ExpertScratch()
    nbytes = device.prepared_bytes(T.Q8_0, (N, K), "matmul")
    experts = Experts((E, N, K), nbytes, prepare, rows)
    experts.matmul(1)
    x, out = activations(1, K), np.full((1, 2 * N), np.nan, np.float32)
    route = np.array([[1, 5, 0.5, 0.5]], np.float32)
    records, keep = experts.step_records(x, route, out, None, backends.select())
    pool.Program(records, 1)()
    assert isinstance(rows.error, ValueError) and "expert 5's scales" in str(rows.error)
    assert (out[0, N:] == 0).all() and np.isfinite(out[0, :N]).all()


def test_small_steps_run_natively_while_their_expected_rereads_stay_small() -> None:
    """``native_tokens``: a step's pairs beyond the distinct experts they name read an expert
    again each; within ``NATIVE_REREAD_BYTES`` the step runs natively."""

    def experts(n_experts: int, expert_bytes: int) -> Experts:
        return Experts((n_experts, 1, 1), expert_bytes, lambda e: None, ExpertScratch())

    olmoe = experts(64, 1_700_000)  # a Q6_K down expert of OLMoE-1B-7B's shape
    tokens = olmoe.native_tokens(8)
    for t, native in ((tokens, True), (tokens + 1, False)):
        pairs = 8 * t
        rereads = pairs - 64 * (1 - (1 - 1 / 64) ** pairs)
        assert (rereads * olmoe.expert_bytes <= NATIVE_REREAD_BYTES) == native
    assert tokens == 7  # (measured: 8 sequences ran 0.96-0.98x natively, 6 1.08x)
    assert experts(8, 33_000_000).native_tokens(2) == 2  # Mixtral 8x7B
    assert experts(E, 5000).native_tokens(2) == CACHED_ROWS  # tiny experts: every cached step
