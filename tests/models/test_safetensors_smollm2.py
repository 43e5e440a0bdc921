"""SmolLM2's GGUF converted by the test into a Hugging Face directory gives the same model.

The conversion is llama.cpp's, inverted: every tensor dequantised to fp32 (Q4_1's values
are not all fp16 numbers, so fp32 keeps them exact), renamed to HF's names, llama's q/k rows
permuted back into HF's rotate-half layout; config.json from the hyper-parameters;
tokenizer.json from the tokenizer DynaLM built from the GGUF; the GGUF's chat template.
DynaLM must then tokenize the same, and generate the same greedy text in ``exact``
(on two of the prompts: fp32 weights run numpy matmuls, ~50 ms a token).

The same weights as a GPTQ checkpoint (asymmetric, groups of 128, act-order; packed by
`hf_quant`) pass the ``auto`` contract of every format (`test_auto_mode`): top-1 agreement
with ``exact`` >= 98 % and mean KL <= 0.005.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_quant import quantize_linears, write_checkpoint
from safetensors.numpy import save_file
from test_auto_mode import auto_vs_exact
from test_smollm2_fidelity import CONTINUATION, prompts  # noqa: F401

from dynalm.core.cpu_device import CpuDevice
from dynalm.core.quant import dequantize
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.generator import Generator, generator_config

# GGUF name -> HF name (llama), written out here rather than taken from gguf-py's map
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER[rest]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: adjacent rope pairs -> HF's rotate-half halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(gguf_model: LoadedModel) -> dict[str, np.ndarray]:
    hp, out = gguf_model.hparams, {}
    for name, t in gguf_model.gguf.tensors.items():
        w = dequantize(gguf_model.gguf.raw(name), t.ggml_type, t.shape[-1])
        if name.endswith("attn_q.weight"):
            w = _unpermute(w, hp.n_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute(w, hp.n_kv_heads)
        out[_hf_name(name)] = np.ascontiguousarray(w, np.float32)
    return out


def _write_config(gguf_model: LoadedModel, path: Path) -> None:
    hp, tok = gguf_model.hparams, gguf_model.tokenizer
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp.n_vocab,
        "hidden_size": hp.d_model,
        "intermediate_size": hp.d_ff,
        "num_hidden_layers": hp.n_layers,
        "num_attention_heads": hp.n_heads,
        "num_key_value_heads": hp.n_kv_heads,
        "head_dim": hp.head_dim,
        "max_position_embeddings": hp.n_ctx_train,
        "rms_norm_eps": hp.norm_eps,
        "rope_theta": hp.rope_base,
        "tie_word_embeddings": "output.weight" not in gguf_model.gguf.tensors,
    }
    (path / "config.json").write_text(json.dumps(config))
    tok._hf.save(str(path / "tokenizer.json"))  # the tokenizers object DynaLM built
    text = lambda i: tok.decode([i], skip_special=False)  # noqa: E731
    tok_config = {
        "bos_token": text(tok.bos_id),
        "eos_token": text(tok.eos_id),
        "add_bos_token": tok.add_bos,
        "chat_template": gguf_model.chat_template.source,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_id}))


@pytest.fixture(scope="module")
def tensors(model: LoadedModel) -> dict[str, np.ndarray]:  # noqa: F811
    return _hf_tensors(model)


@pytest.fixture(scope="module")
def hf_model(model, tensors, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    path = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    _write_config(model, path)
    save_file(tensors, str(path / "model.safetensors"))
    loaded = load_model(path)
    yield loaded
    loaded.gguf.close()


def _greedy(loaded: LoadedModel, ids: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=CONTINUATION, temperature=0, repeat_penalty=1.0)
    gen = Generator(Engine(loaded, CpuDevice("exact"), generator_config(512)))
    return [e.token for e in gen.generate(ids, params, stop_ids=frozenset()) if e.token]


def test_directory_tokenizes_like_the_gguf(model, hf_model, prompts) -> None:  # noqa: F811
    assert hf_model.hparams == model.hparams
    assert hf_model.stop_token_ids == model.stop_token_ids
    chat = [{"role": "user", "content": "Why is the sky blue?"}]
    assert hf_model.chat_template.render(chat) == model.chat_template.render(chat)
    texts = [model.tokenizer.decode(ids, skip_special=False) for ids in prompts]
    for text, ids in zip(texts, prompts, strict=True):
        assert hf_model.tokenizer.encode(text, add_special=False) == model.tokenizer.encode(
            text, add_special=False
        )
        assert hf_model.tokenizer.decode(ids) == model.tokenizer.decode(ids)


def test_directory_generates_the_ggufs_greedy_text(model, hf_model, prompts) -> None:  # noqa: F811
    for ids in (prompts[0], prompts[-1]):  # a chat and a plain text (fp32 matmuls are slow)
        want = _greedy(model, ids)
        assert _greedy(hf_model, ids) == want, model.tokenizer.decode(want)


def test_gptq_act_order_auto_close_to_exact(model, tensors, prompts, tmp_path) -> None:  # noqa: F811
    path = tmp_path / "gptq"
    _write_config(model, path)
    packed, _ = quantize_linears(tensors, "gptq", 128, sym=False, act_order=True, seed=0)
    write_checkpoint(path, packed, "gptq", 128, sym=False, act_order=True)
    loaded = load_model(path)
    try:
        assert any(n.endswith(".input_perm") for n in loaded.gguf.tensors)
        up = loaded.gguf.tensors["blk.0.ffn_up.weight"]  # Q5_0: int8 kernels
        assert CpuDevice("auto").matmul_kernel(up.ggml_type, up.shape).kind == "jit-auto"
        top1, kl = auto_vs_exact(loaded, prompts)
        assert top1 >= 0.98, f"top-1 agreement {top1:.4f}"
        assert kl <= 0.005, f"mean KL {kl:.5f}"
    finally:
        loaded.gguf.close()
