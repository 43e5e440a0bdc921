"""A gemma-3-shaped GGUF with a 262,144-token vocabulary and random weights, for memory tests.

What makes such a model costly to hold is its vocabulary: a 262k x d_model embedding that
is also the output head (tied, as in every gemma3 file), a 262k-wide logits row, and a
sentencepiece tokenizer with hundreds of thousands of merges. The layers are few; their
tensors are a Q4_K_M-like mix, chosen as llama.cpp's quantiser chooses for gemma-3 270M:
K-quants where a row is a multiple of 256 weights, Q5_0 / Q8_0 where it is not (d_model
640), the embedding in Q8_0. Weights are random bytes with small finite scales (no
quantiser needed, so writing the file takes seconds); nothing checks the model's answers.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

VOCAB = 262_144
D_MODEL, N_HEADS, N_KV_HEADS, HEAD_DIM, D_FF = 640, 4, 1, 256, 2048
N_LAYERS = 6  # layers 0-4 local (sliding window), 5 global, as gemma3 alternates
SCALE = 2e-3  # every block's scale: keeps activations finite through the random layers

# Where each block type keeps its f16 scale(s), in bytes from the block's start.
_SCALE_AT = {Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, row bytes] of random quants whose scales are all ``SCALE``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _SCALE_AT[qtype]:
        raw[:, :, at : at + 2] = np.frombuffer(np.float16(SCALE).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _layer_tensors() -> list[tuple[str, Q, tuple[int, int]]]:
    """(name, type, [rows, cols]) of one layer's matrices, Q4_K_M-like."""
    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    return [
        ("attn_q", Q.Q5_0, (q_dim, D_MODEL)),
        ("attn_k", Q.Q5_0, (kv_dim, D_MODEL)),
        ("attn_v", Q.Q8_0, (kv_dim, D_MODEL)),
        ("attn_output", Q.Q4_K, (D_MODEL, q_dim)),
        ("ffn_gate", Q.Q5_0, (D_FF, D_MODEL)),
        ("ffn_up", Q.Q5_0, (D_FF, D_MODEL)),
        ("ffn_down", Q.Q6_K, (D_MODEL, D_FF)),
    ]


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Sentencepiece pieces closed under prefixes (so merges exist, as in a real vocabulary):
    specials, the 256 byte tokens, then every "▁"-word and word of 1-3 letters, then
    4-letter ones until ``VOCAB``. Scores fall with the id, as sentencepiece's do."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    words = (
        "".join(w)
        for n in range(1, 5)
        for w in itertools.product(string.ascii_lowercase, repeat=n)
    )
    for word in words:
        pieces += ["▁" + word, word]
        if len(pieces) >= VOCAB:
            break
    pieces = pieces[:VOCAB]
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (VOCAB - len(types))
    types[3] = gguf.TokenType.UNKNOWN
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(VOCAB - len(specials) - 256)]
    return pieces, scores, types


def write_big_vocab_gguf(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("big-vocab-gemma3")
    writer.add_context_length(8192)
    writer.add_embedding_length(D_MODEL)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(D_FF)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(512)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    pieces, scores, types = _vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)

    def norm(name: str, width: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32))

    embedding = _random_blocks(rng, Q.Q8_0, VOCAB, D_MODEL)
    writer.add_tensor("token_embd.weight", embedding, raw_dtype=Q.Q8_0)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        for name, qtype, (rows, cols) in _layer_tensors():
            raw = _random_blocks(rng, qtype, rows, cols)
            writer.add_tensor(f"{p}{name}.weight", raw, raw_dtype=qtype)
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"{p}{name}.weight", D_MODEL)
        norm(f"{p}attn_q_norm.weight", HEAD_DIM)
        norm(f"{p}attn_k_norm.weight", HEAD_DIM)
    norm("output_norm.weight", D_MODEL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
