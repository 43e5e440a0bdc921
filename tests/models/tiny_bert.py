"""A tiny random-weight BERT encoder as a transformers ``BertModel`` and as a GGUF file
written the way llama.cpp's ``convert_hf_to_gguf.py`` (``BertModel``) writes ``bert``:

* tensor names from gguf-py's own HF -> GGUF name map of the architecture (the pooler, which
  sentence embeddings do not use, is left out as the converter leaves it);
* the WordPiece vocabulary in llama.cpp's "phantom space" spelling (control tokens kept, a
  continuation's ``##`` dropped, ``▁`` before every other token), ``tokenizer.ggml.model``
  ``bert`` and the special ids;
* ``bert.pooling_type`` (1 mean, 2 CLS, 3 last) and ``bert.attention.causal`` false.

`reference_embeddings` is what sentence-transformers computes for such a model (the
transformer, the pooling, then its Normalize module), in torch.

A reranker is a ``BertForSequenceClassification`` of one label (`reference_reranker`),
written as the converter writes one: no pooling-type key, the classifier as ``cls.output``
(``[1, d]``; ``[d]`` with ``squeeze``, as converters that squeeze every tensor wrote it),
``bert.classifier.output_labels``, and the pooler (``bert.pooler.dense``) dropped, unless
``pooler`` keeps it as ``cls`` (the tensor llama.cpp's rank pooling runs, dense + tanh, when
a file has it). `reference_scores` are transformers' logits of each pair, with or without
the pooler.
"""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "embed", "##ding", "dog"]
VOCAB = (
    SPECIALS
    + WORDS
    + list(string.ascii_lowercase)
    + ["##" + c for c in string.ascii_lowercase]
    + list(string.digits)
    + list(".,!?'-")
)
MAX_POSITIONS = 32
POOLING = {"mean": 1, "cls": 2, "last": 3}


def reference_model(
    seed: int = 0, std: float = 0.5, n_layers: int = 2, positions: int = MAX_POSITIONS
) -> BertModel:
    """A random BertModel: every parameter ~ N(0, std) (LayerNorms included, so that a wrong
    norm convention shows), fp32, eager attention."""
    torch.manual_seed(seed)
    model = BertModel(_config(n_layers, positions), add_pooling_layer=False)
    return _randomised(model, std)


def reference_reranker(seed: int = 0, std: float = 0.5, n_layers: int = 2) -> (
    BertForSequenceClassification
):
    """A random cross-encoder of one label (a relevance logit), as `reference_model`."""
    torch.manual_seed(seed)
    model = BertForSequenceClassification(_config(n_layers, MAX_POSITIONS, num_labels=1))
    return _randomised(model, std)


def _randomised(model, std: float):
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model


def _config(n_layers: int, positions: int, **extra) -> BertConfig:
    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=positions,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        attn_implementation="eager",
        **extra,
    )


def reference_tokenizer(tmp: Path) -> BertTokenizer:
    vocab = tmp / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return BertTokenizer(str(vocab), do_lower_case=True)


def _phantom(token: str) -> str:
    if token in SPECIALS:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def write_vocab(w: gguf.GGUFWriter) -> None:
    """``VOCAB`` as llama.cpp's converter writes a BERT vocabulary (WordPiece, phantom space)."""
    w.add_tokenizer_model("bert")
    w.add_token_list([_phantom(t) for t in VOCAB])
    # as the converter's get_vocab_base types them: BERT's special tokens are CONTROL
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in VOCAB]
    w.add_token_types(types)
    for key, token in (("unknown", "UNK"), ("cls", "CLS"), ("seperator", "SEP"),
                       ("padding", "PAD"), ("mask", "MASK")):  # fmt: skip
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", VOCAB.index(f"[{token}]"))


def write_gguf(
    model: BertModel | BertForSequenceClassification,
    path: Path,
    pooling: str = "mean",
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    metadata: dict | None = None,
    pooler: bool = False,
    squeeze: bool = False,
) -> Path:
    cfg = model.config
    reranker = isinstance(model, BertForSequenceClassification)
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_name("tiny-bert")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_causal_attention(False)
    if reranker:  # no pooling key: llama.cpp ranks when asked (--reranking)
        w.add_classifier_output_labels([cfg.id2label[i] for i in sorted(cfg.id2label)])
    elif "bert.pooling_type" not in (metadata or {}):
        w.add_pooling_type(gguf.PoolingType(POOLING[pooling]))
    w.add_token_type_count(cfg.type_vocab_size)
    write_vocab(w)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("position_ids") or hf_name.endswith("token_type_ids"):
            continue
        hf_name = hf_name.removeprefix("bert.")
        if hf_name.startswith("pooler.dense."):
            if not pooler:  # the converter: "we are only using BERT for embeddings"
                continue
            hf_name = hf_name.replace("pooler.dense.", "classifier.dense.")  # -> cls
        elif hf_name.startswith("classifier."):  # BertForSequenceClassification's head
            hf_name = hf_name.replace("classifier.", "classifier.out_proj.")  # -> cls.output
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        a = tensor.detach().to(torch.float32).numpy().copy()
        if squeeze and a.squeeze().ndim:  # as converters that squeeze (a 0-d result kept)
            a = a.squeeze()  # the classifier's [1, d] written as [d]
        if qtype != GGMLQuantizationType.F32 and a.ndim == 2 and "embd" not in name:
            w.add_tensor(name, gguf.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_embeddings(model: BertModel, ids: list[list[int]], pooling: str) -> np.ndarray:
    """sentence-transformers' embeddings of each id list: the last hidden state pooled (mean
    over the tokens, the first token or the last), then L2-normalised. One sequence at a
    time, so no padding enters."""
    out = []
    with torch.no_grad():
        for seq in ids:
            h = model(torch.tensor([seq])).last_hidden_state[0].double()
            pooled = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
            out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(out)


def reference_scores(
    model: BertForSequenceClassification,
    pairs: list[tuple[list[int], list[int]]],
    pooler: bool = True,
) -> np.ndarray:
    """transformers' logit of each (ids, token types) pair, one pair at a time (no padding);
    without ``pooler``: the classifier straight on the [CLS] row, as llama.cpp's converter
    leaves a BERT reranker."""
    out = []
    with torch.no_grad():
        for ids, types in pairs:
            ids_t, types_t = torch.tensor([ids]), torch.tensor([types])
            if pooler:
                logits = model(input_ids=ids_t, token_type_ids=types_t).logits
            else:
                h = model.bert(input_ids=ids_t, token_type_ids=types_t).last_hidden_state
                logits = model.classifier(h[:, 0])
            out.append(float(logits[0, 0]))
    return np.array(out)
