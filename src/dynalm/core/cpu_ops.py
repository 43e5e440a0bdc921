"""The DynaIR ops on the CPU in numpy: the reference the JIT kernels are tested against.

Every op writes into a planned output buffer (``out``), so a step allocates only
numpy temporaries inside ops, never the activations themselves. The attention op
reads keys and values through each sequence's page table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dynalm.core.kv_storage import saturated_f16
from dynalm.kernel.elementwise_programs import MIN_WEIGHT_SUM

if TYPE_CHECKING:
    from dynalm.core.kv_storage import AttentionBatch


def rms_norm(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> None:
    ms = np.einsum("ij,ij->i", x, x) / x.shape[1]
    np.multiply(x, (1.0 / np.sqrt(ms + eps))[:, None], out=out)
    out *= w


def head_rms_norm(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float, head_dim: int) -> None:
    heads = x.reshape(x.shape[0], -1, head_dim)
    ms = np.einsum("thd,thd->th", heads, heads) / head_dim
    np.multiply(heads, (1.0 / np.sqrt(ms + eps))[..., None], out=out.reshape(heads.shape))
    out.reshape(heads.shape)[...] *= w


def yarn_corr_dims(
    rope_dim: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """YaRN's correction range (llama.cpp's ``ggml_rope_yarn_corr_dims``, transformers'
    with ``truncate``): the pairs below ``low`` rotate more than ``beta_fast`` times over
    ``orig_ctx`` positions (kept as trained), those above ``high`` fewer than ``beta_slow``
    (interpolated); a linear ramp between."""

    def dim(rotations: float) -> float:
        return rope_dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(rope_dim - 1.0, math.ceil(dim(beta_slow)))


class RopeTable:
    """cos/sin of position x frequency for one (base, scale, dims) setting, grown on demand;
    frequencies divided by ``freq_factors`` where given, cos and sin times ``attn_factor``
    (LongRoPE's); with ``yarn`` (ext_factor, orig_ctx, beta_fast, beta_slow) and an
    ext_factor, llama.cpp's ``rope_yarn``: each pair's frequency mixed between the scaled
    and the unscaled one by the ramp of `yarn_corr_dims` times ext_factor, and cos and sin
    times 1 + 0.1 ln(scale) more."""

    def __init__(
        self,
        rope_dim: int,
        base: float,
        scale: float,
        freq_factors: np.ndarray | None = None,
        attn_factor: float = 1.0,
        yarn: tuple[float, int, float, float] | None = None,
    ):
        inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        self.inv_freq = inv_freq / scale
        if yarn is not None and yarn[0]:  # (ext_factor, orig_ctx, beta_fast, beta_slow)
            ext_factor, orig_ctx, beta_fast, beta_slow = yarn
            low, high = yarn_corr_dims(rope_dim, orig_ctx, base, beta_fast, beta_slow)
            pair = np.arange(rope_dim // 2, dtype=np.float64)
            mix = (1 - np.clip((pair - low) / max(0.001, high - low), 0, 1)) * ext_factor
            self.inv_freq = self.inv_freq * (1 - mix) + inv_freq * mix
            attn_factor *= 1 + 0.1 * math.log(scale)
        self.attn_factor = attn_factor
        self.cos = self.sin = np.zeros((0, rope_dim // 2), np.float32)

    def ensure(self, n_positions: int) -> bool:
        """Cover positions ``0 .. n_positions - 1``; True if the tables were reallocated."""
        if n_positions <= len(self.cos):
            return False
        n = max(n_positions, 2 * len(self.cos), 256)
        angles = np.outer(np.arange(n, dtype=np.float64), self.inv_freq)
        f = self.attn_factor
        self.cos, self.sin = ((g(angles) * f).astype(np.float32) for g in (np.cos, np.sin))
        return True

    def lookup(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.ensure(int(positions.max()) + 1 if positions.size else 0)
        return self.cos[positions], self.sin[positions]


def rope(
    out: np.ndarray,
    x: np.ndarray,
    positions: np.ndarray,
    table: RopeTable,
    head_dim: int,
    rope_dim: int,
    neox: bool,
) -> None:
    heads = x.reshape(x.shape[0], -1, head_dim)
    res = out.reshape(heads.shape)
    if rope_dim < head_dim:
        res[..., rope_dim:] = heads[..., rope_dim:]
    cos, sin = table.lookup(positions)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rope_dim // 2
    # NeoX pairs element i with i + d/2; the GGUF llama layout pairs 2i with 2i + 1.
    if neox:
        a, b = heads[..., :half], heads[..., half:rope_dim]
        ra, rb = res[..., :half], res[..., half:rope_dim]
    else:
        a, b = heads[..., 0:rope_dim:2], heads[..., 1:rope_dim:2]
        ra, rb = res[..., 0:rope_dim:2], res[..., 1:rope_dim:2]
    a, b = a.copy(), b.copy()  # out may alias x's storage pattern; read before writing
    ra[...] = a * cos - b * sin
    rb[...] = b * cos + a * sin


def silu(out: np.ndarray, x: np.ndarray) -> None:
    np.negative(x, out=out)
    np.exp(out, out=out)
    out += 1.0
    np.divide(x, out, out=out)


def gelu_tanh(out: np.ndarray, x: np.ndarray) -> None:
    inner = x * x * x
    inner *= 0.044715
    inner += x
    inner *= math.sqrt(2.0 / math.pi)
    np.tanh(inner, out=inner)
    inner += 1.0
    np.multiply(x, inner, out=out)
    out *= 0.5


def tanh(out: np.ndarray, x: np.ndarray) -> None:
    np.tanh(x, out=out)


_ERF = np.frompyfunc(math.erf, 1, 1)


def gelu(out: np.ndarray, x: np.ndarray) -> None:
    """GELU, the erf form: x / 2 (1 + erf(x / sqrt 2)) (libm's erf, in double)."""
    y = x.astype(np.float64)
    np.multiply(
        0.5 * y, 1.0 + _ERF(y / math.sqrt(2.0)).astype(np.float64), out=out, casting="unsafe"
    )


def layer_norm(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> None:
    mean = x.mean(axis=1, keepdims=True)
    d = x - mean
    var = np.einsum("ij,ij->i", d, d)[:, None] / x.shape[1]
    np.multiply(d, 1.0 / np.sqrt(var + eps), out=out)
    out *= w
    out += b


def l2_norm(out: np.ndarray, x: np.ndarray) -> None:
    norm = np.sqrt(np.einsum("ij,ij->i", x, x))[:, None]
    np.divide(x, np.maximum(norm, 1e-12), out=out)


def _sequences(last: np.ndarray) -> list[tuple[int, int]]:
    """Each sequence's rows ``[start, end)`` of a step, from its last rows (increasing)."""
    ends = [int(e) + 1 for e in last]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def pool(out: np.ndarray, x: np.ndarray, last: np.ndarray, mode: int) -> None:
    """One row per sequence: the mean of its rows (1), its first (2) or its last (3)."""
    for s, (a, b) in enumerate(_sequences(last)):
        out[s] = x[a:b].mean(axis=0) if mode == 1 else x[a if mode == 2 else b - 1]


def encoder_attention(
    out: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    last: np.ndarray,
    head_dim: int,
    scale: float,
) -> None:
    """Bidirectional attention within each sequence of the step (no mask, no KV cache)."""
    heads = q.shape[1] // head_dim
    for a, b in _sequences(last):
        qs, ks, vs = (t[a:b].reshape(b - a, heads, head_dim) for t in (q, k, v))
        scores = np.einsum("thd,lhd->htl", qs, ks) * np.float32(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[a:b] = np.einsum("htl,lhd->thd", scores, vs).reshape(b - a, -1)


def gated(out: np.ndarray, gate: np.ndarray, up: np.ndarray, activation: str) -> None:
    """The gated FFN's ``act(gate) * up`` (SwiGLU for "silu", GeGLU for "gelu_tanh")."""
    {"silu": silu, "gelu_tanh": gelu_tanh}[activation](out, gate)
    out *= up


def swiglu_oai(
    out: np.ndarray, gate: np.ndarray, up: np.ndarray, alpha: float, limit: float
) -> None:
    """gpt-oss's gated activation (transformers' ``GptOssExperts._apply_gate``, llama.cpp's
    ``ggml_swiglu_oai``): g = min(gate, limit), u = up clamped to [-limit, limit],
    ``out = g * sigmoid(alpha g) * (u + 1)``."""
    g = np.minimum(gate, np.float32(limit))
    np.multiply(g, np.float32(-alpha), out=out)
    with np.errstate(over="ignore"):  # exp(+large) = inf: g / inf = -0, sigmoid's limit
        np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= np.clip(up, np.float32(-limit), np.float32(limit)) + np.float32(1.0)


def attention(
    out: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    batch: AttentionBatch,
    layer: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int,
    *,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> None:
    """Store this step's k/v in the layer's pages, then causal (optionally windowed)
    attention of each sequence's queries over its whole paged context, the scaled scores
    capped at ``softcap * tanh(s / softcap)`` when ``softcap`` > 0, each head's ``sinks``
    logit (f32 [n_heads]) one more term of its softmax's denominator; with recent
    buffers, keys and values within ``kv.recent`` positions of a query are read in f16
    (see ``kv_cache``), and the step's last ``kv.recent`` tokens are stored there after."""
    kv = batch.kv
    t_total = q.shape[0]
    k, v = (x.reshape(t_total, n_kv_heads, head_dim) for x in (k, v))
    kv.write(layer, batch.slots, k, v)
    group = n_heads // n_kv_heads
    page_offsets = np.arange(kv.page_size)
    recent, later = kv.recent, []
    for s in range(len(batch.seq_lens)):
        a, b = int(batch.query_start[s]), int(batch.query_start[s + 1])
        n_ctx = int(batch.seq_lens[s])
        n_pages = -(-n_ctx // kv.page_size)
        slots = (batch.page_tables[s][:n_pages, None] * kv.page_size + page_offsets).ravel()
        slots = slots[:n_ctx]
        keys, values = kv.read(layer, slots)  # [L, kv, d] fp32
        queries = q[a:b].reshape(b - a, n_kv_heads, group, head_dim)
        scores = np.einsum("tkgd,lkd->kgtl", queries, keys)
        qpos = positions[a:b, None]
        kpos = np.arange(n_ctx)[None, :]
        masked = kpos > qpos
        if window:
            masked |= kpos <= qpos - window
        if recent:  # positions [lo, n_ctx) in f16: earlier steps' from the buffer, then ours
            start, base = n_ctx - (b - a), int(batch.recent[s]) * recent
            lo = max(int(batch.recent_from[s]), start - recent + 1, 0)
            near_k, near_v = kv.read_recent(layer, base + np.arange(lo, start) % recent)
            near_k = np.concatenate([near_k, saturated_f16(k[a:b]).astype(np.float32)])
            near_v = np.concatenate([near_v, saturated_f16(v[a:b]).astype(np.float32)])
            near = (kpos[:, lo:] > qpos - recent) & (kpos[:, lo:] >= batch.recent_from[s])
            near_scores = np.einsum("tkgd,lkd->kgtl", queries, near_k)
            scores[..., lo:] = np.where(near, near_scores, scores[..., lo:])
            keep = slice(max(a, b - recent), b)  # the step's last tokens, stored after
            later.append((base + positions[keep] % recent, k[keep], v[keep]))
        scores *= np.float32(scale)
        if softcap:
            scores /= np.float32(softcap)
            np.tanh(scores, out=scores)
            scores *= np.float32(softcap)
        scores[..., masked] = -np.inf
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:
            sink = sinks.reshape(n_kv_heads, group, 1, 1)
            top = np.maximum(top, sink)
        scores -= top
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total += np.exp(sink - top)
        scores /= total
        if recent:
            near_weights = np.where(near, scores[..., lo:], 0)
            scores[..., lo:] -= near_weights
            ctx = np.einsum("kgtl,lkd->tkgd", near_weights, near_v)
            ctx += np.einsum("kgtl,lkd->tkgd", scores, values)
        else:
            ctx = np.einsum("kgtl,lkd->tkgd", scores, values)
        out[a:b] = ctx.reshape(b - a, n_heads * head_dim)
    for rows, keys, values in later:  # after every sequence read the buffers
        kv.write_recent(layer, rows, keys, values)


# --- mixture of experts --------------------------------------------------------------------


def moe_route(
    out: np.ndarray, logits: np.ndarray, top_k: int, gating: int, normalize: bool, scale: float
) -> None:
    """Row t of ``out``: the ids of the ``top_k`` most probable experts (as f32; highest
    first, ties to the lower id), then their weights. ``gating`` 1: a softmax over every
    logit, 2: each logit's sigmoid; ``normalize`` divides the chosen weights by their sum,
    then ``scale`` multiplies them. Experts are ranked by their logits: both gatings keep
    the order, and unlike the probabilities two different logits never tie (a softmax
    underflows to 0 far below the largest)."""
    if gating == 1:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    else:
        with np.errstate(over="ignore"):  # exp(-x) of a very negative x: inf, weight 0
            probs = 1.0 / (1.0 + np.exp(-logits))
    # a stable sort of the negated logits: equal ones keep their (id) order
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    if normalize:
        weights /= np.maximum(weights.sum(axis=1, keepdims=True), np.float32(MIN_WEIGHT_SUM))
    out[:, :top_k] = ids
    np.multiply(weights, np.float32(scale), out=out[:, top_k:])


def route_ids(route: np.ndarray, n_experts: int) -> np.ndarray:
    """A route's expert ids ``[T, top_k]`` as integers, each checked to name an expert."""
    ids = route[:, : route.shape[1] // 2]
    if ids.size and not (ids.min() >= 0 and ids.max() < n_experts):
        raise ValueError(f"a route names expert {ids.max():g} of {n_experts}")
    return ids.astype(np.intp)


def expert_matmul(
    out: np.ndarray,
    x: np.ndarray,
    route: np.ndarray,
    matmul: Callable[[int], Callable[[np.ndarray, np.ndarray], None]],
    shape: tuple[int, int, int],
    bias: np.ndarray | None = None,
) -> None:
    """Slot j of row t (columns ``j*N..(j+1)*N`` of ``out``) = x's row for the slot @ the
    weight ``[N, K]`` of expert ``e = route[t, j]`` (``matmul(e)(rows, result)``), +
    ``bias[e]``; the experts are ``shape`` ``[E, N, K]``. x's row for slot j: x[t] (x is
    [T, K]) or its columns j*K..(j+1)*K (x is [T, top_k * K])."""
    n_experts, n, k_in = shape
    ids = route_ids(route, n_experts)
    for j in range(ids.shape[1]):
        xs = x if x.shape[1] == k_in else x[:, j * k_in : (j + 1) * k_in]
        for e in np.unique(ids[:, j]):
            rows = np.flatnonzero(ids[:, j] == e)
            y = np.empty((len(rows), n), np.float32)
            matmul(int(e))(np.ascontiguousarray(xs[rows]), y)
            out[rows, j * n : (j + 1) * n] = y if bias is None else y + bias[e]


def moe_combine(out: np.ndarray, y: np.ndarray, route: np.ndarray) -> None:
    """``out[t] = sum_j route[t, k + j] * y[t, j*N:(j+1)*N]``, slots added in order."""
    k = route.shape[1] // 2
    n = out.shape[1]
    np.multiply(y[:, :n], route[:, k : k + 1], out=out)
    for j in range(1, k):
        out += y[:, j * n : (j + 1) * n] * route[:, k + j : k + j + 1]
