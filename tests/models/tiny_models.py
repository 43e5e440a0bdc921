"""Tiny random-weight models of several families, as transformers modules and as GGUF files.

`reference_model` builds a small transformers model of a family (``gemma2``, ``phi3``,
``llama``, ``qwen2``, ``gemma3``, ``qwen3``, ``olmo2``, and the mixtures of experts
``qwen3moe``, ``olmoe``, ``mixtral``) with every parameter drawn at random, norms included
(transformers initialises them to 0 or 1, which would hide a wrong norm convention).
`write_gguf` writes it the way llama.cpp's ``convert_hf_to_gguf.py`` does for that family,
with a minimal byte-level ``gpt2`` tokenizer (six merges) so `dynalm.models.loader.load_model`
and llama.cpp (tests/models/test_llama_cpp_loads.py) can load it (phi3 with
``for_llama_cpp``, see there):

* tensor names from gguf-py's own HF -> GGUF name map of the architecture;
* llama: q/k rows permuted (``permute(w, n_head)``) from HF's rotate-half layout into
  llama.cpp's adjacent-pair layout;
* gemma2, gemma3: ``+ 1`` added to every RMSNorm weight (q/k norms too), since Gemma's norm
  multiplies by ``1 + w``; the head is always tied to the embeddings;
* mixtures of experts: transformers 5 keeps each layer's experts as two stacked parameters,
  ``experts.gate_up_proj`` [E, 2 ff, d] and ``experts.down_proj`` [E, d, ff]; the converter
  splits the first into ``ffn_gate_exps`` and ``ffn_up_exps`` [E, ff, d] (numpy order) and
  writes the router (``ffn_gate_inp``) in F32 whatever the file type; Mixtral is written as
  GGUF architecture ``llama`` (q/k permuted) with ``blk.N.ffn_*_exps`` tensors;
* phi3: q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``); with LongRoPE, the short
  and long frequency factors as the tensors ``rope_factors_short/long.weight`` and the
  attention factor ``sqrt(1 + ln(s) / ln(orig))`` (s = max / original positions) as
  ``rope.scaling.attn_factor``;
* ``{arch}.*`` hyper-parameters as the converter names them.

With ``qtype`` other than F32 the 2-D weights are stored quantised; `dequantize_weights`
puts the same rounding into the reference model, so both compute the same math.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # "<|endoftext|>", right after the 256 byte tokens
# GPT-2's first BPE merges; their tokens end the vocabulary. A byte-level BPE file needs a
# merge list: llama.cpp refuses a "gpt2" tokenizer without tokenizer.ggml.merges (and
# gguf-py writes no key for an empty array).
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n"]


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: its family and the traits the tests vary."""

    # gemma2 | phi3 | llama | qwen2 | gemma3 | qwen3 | olmo2 | qwen3moe | olmoe | mixtral | gpt-oss
    family: str
    n_layers: int
    rope_theta: float
    tied: bool  # the head shares token_embd.weight (no output.weight in the GGUF)
    sliding_window: int = 0  # gemma2, gemma3, gpt-oss
    seed: int = 0
    # gemma2: the caps of the attention scores and of the logits (0: none)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # phi3: LongRoPE over this fraction of each head (transformers' partial_rotary_factor)
    long_rope: bool = False
    rotary: float = 1.0


SPECS: dict[str, TinySpec] = {
    # 3 layers: 0 and 2 are local (sliding window 4), 1 is global (llama.cpp: i % 2 == 0 is
    # local); caps small enough to bind on these random weights (scores and logits of
    # several units; `test_gemma2_soft_capping_binds`)
    "gemma2": TinySpec(
        "gemma2",
        n_layers=3,
        rope_theta=10000.0,
        tied=True,
        sliding_window=4,
        seed=6,
        attn_softcap=4.0,
        final_softcap=8.0,
    ),
    "phi3": TinySpec("phi3", n_layers=2, rope_theta=10000.0, tied=False, seed=7),
    # LongRoPE trained on 16 positions and stretched to 256: the 20-token input is past the
    # trained context, so transformers reads the long factors, as DynaLM does with any
    # --ctx above 16; rope over half of each head (as Phi-4 mini's 3/4)
    "phi3-longrope": TinySpec(
        "phi3", n_layers=2, rope_theta=10000.0, tied=False, seed=8, long_rope=True, rotary=0.5
    ),
    "llama": TinySpec("llama", n_layers=3, rope_theta=50000.0, tied=False, seed=1),
    "qwen2": TinySpec("qwen2", n_layers=2, rope_theta=1_000_000.0, tied=True, seed=2),
    # 7 layers: 0-4 and 6 are local (sliding window 4), 5 is global; llama.cpp's rule
    # is that layer i is local when (i + 1) % 6 != 0.
    "gemma3": TinySpec(
        "gemma3", n_layers=7, rope_theta=200_000.0, tied=True, sliding_window=4, seed=3
    ),
    # families with no Python in DynaLM, only their .lum files
    "qwen3": TinySpec("qwen3", n_layers=2, rope_theta=1_000_000.0, tied=True, seed=4),
    "olmo2": TinySpec("olmo2", n_layers=2, rope_theta=500_000.0, tied=False, seed=5),
    # mixtures of experts (`MOE`): N_EXPERTS experts per layer, N_EXPERTS_USED per token
    "qwen3moe": TinySpec("qwen3moe", n_layers=2, rope_theta=1_000_000.0, tied=False, seed=6),
    "olmoe": TinySpec("olmoe", n_layers=2, rope_theta=10_000.0, tied=False, seed=7),
    "mixtral": TinySpec("mixtral", n_layers=2, rope_theta=1_000_000.0, tied=False, seed=8),
    # even layers local (window 4), odd ones global; MXFP4 experts whatever the file type
    "gpt-oss": TinySpec(
        "gpt-oss", n_layers=3, rope_theta=150_000.0, tied=False, sliding_window=4, seed=9
    ),
}

_ARCH = {
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,  # llama.cpp's converter writes Mixtral as llama
    "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
}

_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
GEMMA_LOCAL_ROPE_BASE = 10000.0  # llama.cpp (and DynaLM) hard-code gemma3's local base
# The mixture-of-experts families and their experts: 8 per layer, 2 chosen per token, each a
# SwiGLU FFN 32 wide (qwen3moe's dense intermediate_size stays 128, unused, as the converter
# writes it as feed_forward_length)
MOE = ("qwen3moe", "olmoe", "mixtral", "gpt-oss")
N_EXPERTS, N_EXPERTS_USED, EXPERT_FF = 8, 2, 32
MXFP4 = GGMLQuantizationType.MXFP4
# gpt-oss's YaRN: factor 4 over 64 trained positions (256 in all); with head_dim 16 and base
# 150000, pair 0 keeps its frequency, 1 is half-way, 2-7 are interpolated
GPT_OSS_YARN = (4.0, 64)


def gguf_arch(spec: TinySpec) -> str:
    """The ``general.architecture`` the converter writes for ``spec``'s family."""
    return gguf.MODEL_ARCH_NAMES[_ARCH[spec.family]]


LONG_ROPE_ORIGINAL = 16  # a LongRoPE phi3's trained context (max_position_embeddings: 256)


def long_rope_factors(spec: TinySpec) -> dict[str, list[float]]:
    """A LongRoPE phi3's frequency factors, one per rotated pair: short ones near 1 and
    long ones up to 8, both rising with the wavelength, as the real ones do."""
    pairs = int(_DIMS["head_dim"] * spec.rotary) // 2
    return {
        "short_factor": np.linspace(1.0, 1.5, pairs).tolist(),
        "long_factor": np.linspace(1.0, 8.0, pairs).tolist(),
    }


def _config(spec: TinySpec) -> PretrainedConfig:
    common = dict(
        _DIMS,
        num_hidden_layers=spec.n_layers,
        tie_word_embeddings=spec.tied,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
    )
    if spec.family == "gemma2":
        assert spec.tied, "llama.cpp's gemma2 always ties the head to the embeddings"
        return Gemma2Config(
            **common,
            sliding_window=spec.sliding_window,
            query_pre_attn_scalar=_DIMS["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim)
            hidden_activation="gelu_pytorch_tanh",
            attn_logit_softcapping=spec.attn_softcap or None,
            final_logit_softcapping=spec.final_softcap or None,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        )
    if spec.family == "phi3":
        rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
        original = _DIMS["max_position_embeddings"]
        if spec.long_rope:
            rope = {**rope, "rope_type": "longrope", **long_rope_factors(spec)}
            original = LONG_ROPE_ORIGINAL
        return Phi3Config(
            **common,
            original_max_position_embeddings=original,
            rope_parameters={**rope, "partial_rotary_factor": spec.rotary},
        )
    if spec.family == "llama":
        return LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}
        )
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.family == "qwen2":  # Qwen2's q/k/v projections always carry biases
        return Qwen2Config(**common, rope_parameters=rope)
    if spec.family == "qwen3":  # no biases, an RMSNorm over each head of q and k
        return Qwen3Config(**common, rope_parameters=rope)
    if spec.family == "olmo2":  # post-norms, an RMSNorm over all of q and of k
        return Olmo2Config(**common, rope_parameters=rope)
    experts = dict(num_experts_per_tok=N_EXPERTS_USED, rope_parameters=rope)
    if spec.family == "qwen3moe":  # qwen3's per-head q/k norms; every layer's FFN experts
        # llama.cpp's qwen3moe graph always renormalises the chosen weights
        return Qwen3MoeConfig(
            **common,
            **experts,
            num_experts=N_EXPERTS,
            moe_intermediate_size=EXPERT_FF,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if spec.family == "olmoe":
        # olmo's q/k norms over all of q and of k, not renormalised; llama.cpp reads k's norm
        # as d_model wide (no GQA) and its converter writes eps 1e-5 whatever the config says
        own = dict(intermediate_size=EXPERT_FF, num_key_value_heads=4, rms_norm_eps=1e-5)
        return OlmoeConfig(
            **(common | own),
            **experts,
            num_experts=N_EXPERTS,
            norm_topk_prob=False,
            clip_qkv=None,
        )
    if spec.family == "mixtral":  # llama with experts, renormalised
        return MixtralConfig(
            **(common | dict(intermediate_size=EXPERT_FF)),
            **experts,
            num_local_experts=N_EXPERTS,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    if spec.family == "gpt-oss":
        # biases on q/k/v/o, the router and the experts; attention sinks; layer_types by
        # default: even layers sliding; YaRN (llama.cpp truncates the correction range:
        # transformers does so with truncate, which gpt-oss's own config leaves false)
        yarn = dict(rope, rope_type="yarn", factor=GPT_OSS_YARN[0], beta_fast=32.0)
        yarn |= dict(beta_slow=1.0, truncate=True, original_max_position_embeddings=GPT_OSS_YARN[1])
        return GptOssConfig(
            **(common | dict(intermediate_size=EXPERT_FF, rms_norm_eps=1e-5)),
            **(experts | dict(rope_parameters=yarn)),
            num_local_experts=N_EXPERTS,
            sliding_window=spec.sliding_window,
            attention_bias=True,
        )
    if spec.family == "gemma3":
        assert spec.tied, "llama.cpp's gemma3 always ties the head to the embeddings"
        layer_types = [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(spec.n_layers)
        ]
        return Gemma3TextConfig(
            **common,
            layer_types=layer_types,
            sliding_window=spec.sliding_window,
            query_pre_attn_scalar=_DIMS["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim)
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA_LOCAL_ROPE_BASE},
            },
        )
    raise ValueError(f"unknown family {spec.family!r}")


_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "gemma2": Gemma2ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "gpt-oss": GptOssForCausalLM,
}


def reference_model(spec: TinySpec, std: float = 0.5) -> PreTrainedModel:
    """The transformers model of ``spec``, fp32, eager attention, every parameter ~ N(0, std)."""
    torch.manual_seed(spec.seed)
    config = _config(spec)
    config._attn_implementation = "eager"
    model = _MODEL_CLASSES[spec.family](config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():  # tied parameters are listed once
            param.normal_(0.0, std)
        if spec.family == "gpt-oss":  # released with MXFP4 experts: the reference's are too
            for name, param in model.named_parameters():
                if name.endswith(_EXPERT_STACKS):
                    param.copy_(_gpt_oss_mxfp4(param))
    if spec.family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if spec.tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


_EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")


def _gpt_oss_mxfp4(param: torch.Tensor) -> torch.Tensor:
    """A gpt-oss expert stack rounded to MXFP4 as the GGUF stores it: transformers keeps it
    transposed ([E, in, out]), the file [E, out, in] with blocks of 32 along ``in``."""
    w = param.detach().transpose(-1, -2).numpy()
    rounded = gguf.quants.dequantize(gguf.quants.quantize(w, MXFP4), MXFP4).reshape(w.shape)
    return torch.from_numpy(rounded).transpose(-1, -2)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF rotate-half rows -> interleaved rope pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _quantizable(gguf_name: str, w: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """Whether the converter stores GGUF tensor ``gguf_name`` as ``qtype``: the 2-D weights
    and the stacked experts, but a router (``ffn_gate_inp``: always F32)."""
    return (
        qtype != GGMLQuantizationType.F32
        and w.ndim in (2, 3)
        and gguf_name.endswith(".weight")
        and not gguf_name.endswith("ffn_gate_inp.weight")
    )


def _stored_type(
    spec: TinySpec,
    gguf_name: str,
    w: np.ndarray,
    qtype: GGMLQuantizationType,
    released_experts: bool = True,
) -> GGMLQuantizationType:
    """The type the converter stores GGUF tensor ``gguf_name`` as: gpt-oss's experts are
    MXFP4 in the released checkpoints and written as they are, whatever the file type (a
    checkpoint whose experts are not MXFP4, ``released_experts`` False, gets them as
    any weight)."""
    if spec.family == "gpt-oss" and gguf_name.endswith("_exps.weight") and released_experts:
        return MXFP4
    return qtype if _quantizable(gguf_name, w, qtype) else GGMLQuantizationType.F32


def _hf_quantized(hf_name: str, w: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """`_quantizable` for the transformers parameter ``hf_name``, whose GGUF tensors carry the
    same values (the stacked experts have no ``.weight`` suffix; ``mlp.gate`` and gpt-oss's
    ``mlp.router`` are routers)."""
    if hf_name.endswith(_EXPERT_STACKS):
        return qtype != GGMLQuantizationType.F32
    router = hf_name.replace("mlp.gate.weight", "ffn_gate_inp.weight")
    return _quantizable(router.replace("mlp.router.weight", "ffn_gate_inp.weight"), w, qtype)


def _expert_tensors(hf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A stacked expert parameter as the converter's per-projection names (``Qwen2MoeModel.
    modify_tensors``): gate_up_proj [E, 2 ff, d] splits into gate_proj and up_proj."""
    base = hf_name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
    if hf_name.endswith(".down_proj"):
        return [(f"{base}.down_proj.weight", w)]
    ff = w.shape[1] // 2
    return [(f"{base}.gate_proj.weight", w[:, :ff]), (f"{base}.up_proj.weight", w[:, ff:])]


def _gpt_oss_tensors(hf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A gpt-oss parameter as the converter writes it (``GptOssModel``): the sinks get a
    ``.weight`` suffix; the experts, stored transposed ([E, in, out]), are transposed back
    and gate_up_proj (and its bias) de-interleaved: even columns the gate, odd the up."""
    if hf_name.endswith("self_attn.sinks"):
        return [(f"{hf_name}.weight", w)]
    if not hf_name.endswith(("experts.gate_up_proj", "experts.down_proj", "_bias")):
        return [(hf_name, w)]
    base = hf_name.rsplit(".", 1)[0]
    bias = hf_name.endswith("_bias")
    suffix = "bias" if bias else "weight"
    w = w if bias else w.swapaxes(-1, -2)  # [E, out, in]
    if "down_proj" in hf_name:
        return [(f"{base}.down_proj.{suffix}", w)]
    gate, up = (w[..., 0::2], w[..., 1::2]) if bias else (w[:, 0::2], w[:, 1::2])
    return [(f"{base}.gate_proj.{suffix}", gate), (f"{base}.up_proj.{suffix}", up)]


def gguf_tensors(model: PreTrainedModel, spec: TinySpec) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names, transformed as the converter does (fp32)."""
    cfg = model.config
    names = gguf.get_tensor_name_map(_ARCH[spec.family], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    permuted = _ARCH[spec.family] == gguf.MODEL_ARCH.LLAMA  # llama and mixtral
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and spec.tied:
            continue
        w = tensor.detach().to(torch.float32).numpy().copy()
        if permuted and hf_name.endswith("q_proj.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif permuted and hf_name.endswith("k_proj.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        if spec.family in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1.0
        parts = [(hf_name, w)]
        if spec.family == "gpt-oss":
            parts = _gpt_oss_tensors(hf_name, w)
        elif hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = _expert_tensors(hf_name, w)
        for part, value in parts:
            name = names.get_name(part, try_suffixes=(".weight", ".bias"))
            assert name is not None, f"no GGUF name for {part}"
            out[name] = np.ascontiguousarray(value)
    if spec.long_rope:  # the converter's generate_extra_tensors
        for key, factors in long_rope_factors(spec).items():
            out[f"rope_factors_{key.split('_')[0]}.weight"] = np.array(factors, np.float32)
    return out


def _byte_tokens() -> list[str]:
    """GPT-2's 256 byte-level characters, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _vocabulary(vocab_size: int) -> tuple[list[str], list[gguf.TokenType]]:
    """The tiny models' tokens and their types: the 256 bytes, the special tokens, unused
    control tokens, then the tokens `MERGES` make."""
    merged = [m.replace(" ", "") for m in MERGES]
    specials = SPECIAL_TOKENS + [
        f"<|extra_{i}|>" for i in range(vocab_size - 256 - len(SPECIAL_TOKENS) - len(merged))
    ]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(specials)
    return _byte_tokens() + specials + merged, types + [gguf.TokenType.NORMAL] * len(merged)


def write_gguf(
    model: PreTrainedModel,
    spec: TinySpec,
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    pooling_type: gguf.PoolingType | None = None,
    for_llama_cpp: bool = False,
    released_experts: bool = True,
) -> Path:
    """Write ``model`` as llama.cpp's converter would, 2-D weights as ``qtype``; with a
    ``pooling_type`` it is an embedding model (``{arch}.pooling_type``, as the converter
    writes Qwen3-Embedding's). ``for_llama_cpp``: a name without "phi3", whose SPM token
    rules in llama.cpp's vocabulary loader want ``</s>``, a token the tiny vocabulary lacks.
    ``released_experts``: see `_stored_type`."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, gguf_arch(spec))
    writer.add_name(f"tiny-{spec.family}".replace("phi3", "p3" if for_llama_cpp else "phi3"))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if spec.family != "phi3":  # (phi3's converter leaves the head size to d_model / heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if spec.family == "phi3":
        rope = cfg.rope_parameters
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_rope_dimension_count(
            int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
        )
        writer.add_sliding_window(cfg.sliding_window or 0)
        if spec.long_rope:
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            orig = cfg.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
    if spec.family == "gemma2":
        writer.add_attn_logit_softcapping(spec.attn_softcap)
        writer.add_final_logit_softcapping(spec.final_softcap)
        writer.add_sliding_window(cfg.sliding_window)
    if _ARCH[spec.family] == gguf.MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(cfg.head_dim)
    if spec.family in ("gemma3", "gpt-oss"):
        writer.add_sliding_window(cfg.sliding_window)
    if spec.family in MOE:  # TextModel.set_gguf_parameters; the experts' width
        writer.add_expert_count(N_EXPERTS)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if spec.family == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if spec.family == "gpt-oss":
            writer.add_expert_feed_forward_length(cfg.intermediate_size)
    if spec.family == "gpt-oss":  # TextModel.set_gguf_parameters' YaRN keys
        rope = cfg.rope_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q8_0
        if qtype == GGMLQuantizationType.Q8_0
        else gguf.LlamaFileType.ALL_F32
    )

    tokens, types = _vocabulary(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOS_ID)
    writer.add_eos_token_id(EOS_ID)

    for name, w in gguf_tensors(model, spec).items():
        stored = _stored_type(spec, name, w, qtype, released_experts)
        if stored != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, stored), raw_dtype=stored)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantize_weights(model: PreTrainedModel, qtype: GGMLQuantizationType) -> None:
    """Round the reference's weights exactly as `write_gguf` stores them with ``qtype``.

    Quantisation blocks run along rows, so llama's q/k row permutation and the split of
    the experts' gate_up_proj commute with it. gpt-oss's experts are MXFP4 already
    (`reference_model`) and stay so in the file.
    """
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights come once
            w = param.detach().numpy()
            if gpt_oss and name.endswith(_EXPERT_STACKS):
                continue
            if _hf_quantized(name, w, qtype):
                rounded = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
                param.copy_(torch.from_numpy(rounded.reshape(w.shape)))


def write_hf_dir(model: PreTrainedModel, path: Path, **save: object) -> Path:
    """``model`` as a Hugging Face directory (``save_pretrained``: config.json, SafeTensors)
    with a byte-level BPE ``tokenizer.json`` of the same vocabulary as `write_gguf`'s, built
    with `tokenizers` itself, and a tokenizer_config.json naming its special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model.save_pretrained(path, safe_serialization=True, **save)
    tokens, types = _vocabulary(model.config.vocab_size)
    merges = [tuple(m.split(" ")) for m in MERGES]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == gguf.TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True) for t in control])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def reference_embeddings(
    model: PreTrainedModel, ids: list[list[int]], pooling: gguf.PoolingType
) -> np.ndarray:
    """A decoder's sentence embeddings as sentence-transformers makes Qwen3-Embedding's:
    transformers' last hidden state (the final norm's output) of the last token, or its
    mean over the tokens, L2-normalised (float64)."""
    out = []
    for s in ids:
        with torch.no_grad():
            h = model.model(torch.tensor([s])).last_hidden_state[0].double().numpy()
        v = h[-1] if pooling == gguf.PoolingType.LAST else h.mean(0)
        out.append(v / np.linalg.norm(v))
    return np.array(out)
