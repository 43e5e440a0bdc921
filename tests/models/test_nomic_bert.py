"""The ``nomic-bert`` family (``nomic_bert.lum``) against a reference written from its
equations.

transformers has no NomicBert class offline (nomic-embed-text runs HF "remote code"), so the
reference here is a short torch forward written from the model's equations, as nomic's
modelling code and llama.cpp's ``build_bert`` compute them: token (+ type 0) embeddings and a
LayerNorm; per layer a fused ``Wqkv`` projection without bias, rotary positions on q and k
in NeoX halves (``rotary_emb_interleaved`` false) of base ``rotary_emb_base``, bidirectional
softmax attention, ``out_proj``, residual and LayerNorm (``norm1``), then
``fc2(fc11(x) * silu(fc12(x)))``, residual and LayerNorm (``norm2``); pooled and
L2-normalised. The GGUF is written as llama.cpp's ``convert_hf_to_gguf.py`` writes
``nomic-bert``: HF names through gguf-py's own name map, its keys, the phantom-space
WordPiece vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny_bert
import torch

from dynalm.errors import ModelFormatError
from dynalm.models.loader import load_model
from dynalm.runtime.embed import Embedder

D, HEADS, FF, LAYERS, BASE, EPS = 32, 4, 64, 2, 1000.0, 1e-12
TEXTS = ["Hello world!", "the cat sat on the mat.", "Embeddings, dog?", "a b c d e f g h"]


def random_weights(seed: int = 0, std: float = 0.5) -> dict[str, torch.Tensor]:
    """A nomic-bert state dict under nomic's HF names (no biases but the LayerNorms')."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    v = len(tiny_bert.VOCAB)
    w = {"embeddings.word_embeddings.weight": r(v, D),
         "embeddings.token_type_embeddings.weight": r(2, D),
         "emb_ln.weight": 1 + r(D), "emb_ln.bias": r(D)}  # fmt: skip
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        w |= {p + "attn.Wqkv.weight": r(3 * D, D), p + "attn.out_proj.weight": r(D, D),
              p + "mlp.fc11.weight": r(FF, D), p + "mlp.fc12.weight": r(FF, D),
              p + "mlp.fc2.weight": r(D, FF) / 2,
              p + "norm1.weight": 1 + r(D), p + "norm1.bias": r(D),
              p + "norm2.weight": 1 + r(D), p + "norm2.bias": r(D)}  # fmt: skip
    return w


def write_gguf(w: dict[str, torch.Tensor], path: Path, pooling: int = 1, **keys) -> Path:
    out = gguf.GGUFWriter(str(path), "nomic-bert")
    out.add_name("tiny-nomic")
    out.add_context_length(2048)  # as the converter: n_ctx 2048 (the config's 8192 is scaled)
    out.add_embedding_length(D)
    out.add_feed_forward_length(FF)
    out.add_block_count(LAYERS)
    out.add_head_count(HEADS)
    out.add_layer_norm_eps(EPS)
    out.add_causal_attention(False)
    out.add_pooling_type(gguf.PoolingType(pooling))
    out.add_rope_freq_base(BASE)
    out.add_token_type_count(2)
    for key, value in keys.items():
        out.add_uint32(key, value)
    tiny_bert.write_vocab(out)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, LAYERS)
    for hf_name, t in w.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        out.add_tensor(name, t.numpy().astype(np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


def _rope(x: torch.Tensor) -> torch.Tensor:
    """[L, D] rotated per head in NeoX halves: pair (j, j + hd/2) by pos * BASE^(-2j/hd)."""
    hd, n = D // HEADS, x.shape[0]
    x = x.view(n, HEADS, hd)
    inv = BASE ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]  # [L, hd/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).view(n, D)


def reference(w: dict[str, torch.Tensor], ids: list[int], pooling: str) -> np.ndarray:
    """One sequence's embedding from the equations (module docstring), in float64."""
    w = {k: v.double() for k, v in w.items()}
    ln = torch.nn.functional.layer_norm
    x = w["embeddings.word_embeddings.weight"][ids]
    x = x + w["embeddings.token_type_embeddings.weight"][0]  # every token of type 0
    x = ln(x, (D,), w["emb_ln.weight"], w["emb_ln.bias"], EPS)
    hd = D // HEADS
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ w[p + "attn.Wqkv.weight"].T).split(D, -1)
        q, k = _rope(q), _rope(k)
        q, k, v = (t.view(-1, HEADS, hd).transpose(0, 1) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(1, 2) / hd**0.5, -1) @ v
        o = att.transpose(0, 1).reshape(-1, D) @ w[p + "attn.out_proj.weight"].T
        x = ln(x + o, (D,), w[p + "norm1.weight"], w[p + "norm1.bias"], EPS)
        up, gate = x @ w[p + "mlp.fc11.weight"].T, x @ w[p + "mlp.fc12.weight"].T
        f = (up * torch.nn.functional.silu(gate)) @ w[p + "mlp.fc2.weight"].T
        x = ln(x + f, (D,), w[p + "norm2.weight"], w[p + "norm2.bias"], EPS)
    pooled = {"mean": x.mean(0), "cls": x[0], "last": x[-1]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("mode", ["safe", "exact", "auto"])
def test_embeddings_match_the_equations(weights, tmp_path: Path, pooling, mode) -> None:
    path = write_gguf(weights, tmp_path / "nomic.gguf", tiny_bert.POOLING[pooling])
    model = load_model(path)
    emb = Embedder(model, backend="cpu", mode=mode)
    ids = [emb.tokenize(t) for t in TEXTS]
    got = emb.embed(ids)  # all four in one packed step
    want = np.stack([reference(weights, s, pooling) for s in ids])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= {"safe": 0.99999, "exact": 0.99999, "auto": 0.999}[mode]


def test_positions_restart_in_each_packed_sequence(weights, tmp_path: Path) -> None:
    """A sequence's vector does not depend on what is packed before it (rope positions and
    attention bounds are per sequence)."""
    emb = Embedder(load_model(write_gguf(weights, tmp_path / "n.gguf")), backend="cpu",
                   mode="exact")  # fmt: skip
    ids = [emb.tokenize(t) for t in TEXTS]
    alone = np.stack([emb.embed([s])[0] for s in ids])
    np.testing.assert_allclose(emb.embed(ids), alone, rtol=1e-5, atol=1e-6)


def test_a_qkv_of_the_wrong_height_is_named(weights, tmp_path: Path) -> None:
    bad = dict(weights)
    bad["encoder.layers.1.attn.Wqkv.weight"] = bad["encoder.layers.1.attn.Wqkv.weight"][: 2 * D]
    with pytest.raises(ModelFormatError, match=r"blk\.1\.attn_qkv\.weight"):
        load_model(write_gguf(bad, tmp_path / "bad.gguf"))
