"""Embedding speed: inputs/s of DynaLM, llama.cpp's embedding mode and sentence-transformers
on torch, on one random-weight all-MiniLM-L6-shaped model (6 layers, width 384, 12 heads,
FFN 1536, a 30,522-token WordPiece vocabulary, mean pooling, L2-normalised).

    python benchmarks/embed_bench.py [--inputs 256] [--min-tokens 16] [--max-tokens 256]
        [--threads 2] [--type f32|f16|q8_0] [--peers dynalm,llama.cpp,torch] [--mode auto]

The model is written once into ``.cache/embed_bench/`` (git-ignored) as a
sentence-transformers folder (``save_pretrained`` + ``modules.json``, ``1_Pooling``,
``2_Normalize``, ``tokenizer.json``) and as the GGUF llama.cpp's ``convert_hf_to_gguf.py``
would write from it (gguf-py's name map, the phantom-space vocabulary). The inputs are
random words of the vocabulary, each word one token, so that every peer sees the same
``--min-tokens`` to ``--max-tokens`` tokens per input ([CLS] and [SEP] included).

Each peer runs in a process of its own, one timed run after a two-input warm-up (model
loading is not timed; tokenisation is): DynaLM's ``Embedder`` (the inputs packed into
steps of 512 tokens); llama-cpp-python's ``Llama(embedding=True).embed`` (n_batch =
n_ubatch = 512, the sequences packed the same way); sentence-transformers'
``SentenceTransformer.encode`` (batch 32, sorted by length), or where it is not installed
the same thing written out: transformers' ``BertModel`` on padded batches of 32 sorted by
length, the mean over the attention mask, ``F.normalize``. The table gives inputs/s,
tokens/s, DynaLM's speed-up, and the smallest cosine of each peer's vectors against
DynaLM's (all peers compute the same function of the same weights).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(  # all-MiniLM-L6-v2's config.json
    vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
    intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
    layer_norm_eps=1e-12, hidden_act="gelu",
)  # fmt: skip
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json
ST = "sentence_transformers.models."


def vocabulary() -> list[str]:
    """The specials, then letter words (2 to 4 letters) up to the vocabulary's size."""
    words = (
        "".join(w) for n in (2, 3, 4) for w in itertools.product(string.ascii_lowercase, repeat=n)
    )
    return SPECIALS + list(itertools.islice(words, SHAPE["vocab_size"] - len(SPECIALS)))


def write_model(folder: Path, gguf_path: Path, ftype: str) -> None:
    """The sentence-transformers folder (random weights, seed 0, N(0, 0.05)) and its GGUF."""
    import gguf
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = vocabulary()
    if not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        model = BertModel(BertConfig(**SHAPE), add_pooling_layer=False).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm.weight" in name:
                    p.uniform_(0.8, 1.2)
                else:
                    p.normal_(0.0, 0.05)
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
        BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=True).save_pretrained(folder)
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "2_Normalize").mkdir(exist_ok=True)
        pooling = {"word_embedding_dimension": SHAPE["hidden_size"],
                   "pooling_mode_mean_tokens": True}  # fmt: skip
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
        (folder / "modules.json").write_text(json.dumps(
            [{"idx": i, "name": str(i), "path": p, "type": ST + t}
             for i, (p, t) in enumerate(modules)]))  # fmt: skip
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
        )
    if gguf_path.exists():
        return
    from safetensors.numpy import load_file

    tensors = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(str(gguf_path), "bert")
    w.add_name("minilm-l6-random")
    w.add_context_length(SHAPE["max_position_embeddings"])
    w.add_embedding_length(SHAPE["hidden_size"])
    w.add_feed_forward_length(SHAPE["intermediate_size"])
    w.add_block_count(SHAPE["num_hidden_layers"])
    w.add_head_count(SHAPE["num_attention_heads"])
    w.add_layer_norm_eps(SHAPE["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(SHAPE["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_token_list([t if t in SPECIALS else "\u2581" + t for t in vocab])  # phantom space
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in vocab]
    )
    for key, token in (("unknown", "[UNK]"), ("cls", "[CLS]"), ("seperator", "[SEP]"),
                       ("padding", "[PAD]"), ("mask", "[MASK]")):  # fmt: skip
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab.index(token))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, SHAPE["num_hidden_layers"])
    for hf_name, a in tensors.items():
        if hf_name.endswith("position_ids"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        a = a.astype(np.float32)
        # as the converter's --outtype f16 / q8_0: 2-D weights but the token types (get_rows)
        if ftype != "f32" and a.ndim == 2 and name != "token_types.weight":
            if ftype == "f16":
                w.add_tensor(name, a.astype(np.float16))
                continue
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quantize(a, q8), raw_dtype=q8)
            continue
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_inputs(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` texts of ``lo``..``hi`` tokens each ([CLS] and [SEP] counted)."""
    rng = np.random.default_rng(seed)
    words = vocabulary()[len(SPECIALS) :]
    return [" ".join(rng.choice(words, int(k) - 2)) for k in rng.integers(lo, hi + 1, n)]


# -- peers: each runs in its own process and prints one JSON line -------------------------
def run_dynalm(args: argparse.Namespace, texts: list[str]) -> tuple[float, int, np.ndarray]:
    from dynalm.models.loader import load_model
    from dynalm.runtime.embed import Embedder

    emb = Embedder(load_model(args.gguf), backend="cpu", mode=args.mode, threads=args.threads)
    emb.embed([emb.tokenize(t) for t in texts[:2]])
    start = time.perf_counter()
    ids = [emb.tokenize(t, i) for i, t in enumerate(texts)]
    out = emb.embed(ids)
    return time.perf_counter() - start, sum(map(len, ids)), out


def run_llama_cpp(args: argparse.Namespace, texts: list[str]) -> tuple[float, int, np.ndarray]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), embedding=True, n_ctx=512, n_batch=512,
                n_ubatch=512, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)  # fmt: skip
    llm.embed(texts[:2])
    start = time.perf_counter()
    out = np.array(llm.embed(texts, normalize=True), np.float32)
    seconds = time.perf_counter() - start
    return seconds, sum(len(llm.tokenize(t.encode())) for t in texts), out


def run_torch(args: argparse.Namespace, texts: list[str]) -> tuple[float, int, np.ndarray]:
    import torch

    torch.set_num_threads(args.threads)
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        SentenceTransformer = None
    if SentenceTransformer is not None:
        model = SentenceTransformer(str(args.folder), device="cpu")
        model.encode(texts[:2])
        start = time.perf_counter()
        out = model.encode(texts, batch_size=32)
        seconds = time.perf_counter() - start
        n = sum(len(model.tokenizer(t)["input_ids"]) for t in texts)
        return seconds, n, np.asarray(out, np.float32)
    from transformers import BertModel, BertTokenizerFast

    bert = BertModel.from_pretrained(args.folder, add_pooling_layer=False).eval()
    tok = BertTokenizerFast.from_pretrained(args.folder)

    def encode(batch: list[str]) -> torch.Tensor:
        enc = tok(batch, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH,
                  return_tensors="pt")  # fmt: skip
        with torch.inference_mode():
            h = bert(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=1)

    encode(texts[:2])
    start = time.perf_counter()
    order = np.argsort([-len(t) for t in texts], kind="stable")  # as SentenceTransformer
    out = np.empty((len(texts), SHAPE["hidden_size"]), np.float32)
    for i in range(0, len(texts), 32):
        rows = order[i : i + 32]
        out[rows] = encode([texts[j] for j in rows]).numpy()
    seconds = time.perf_counter() - start
    return seconds, sum(len(tok(t)["input_ids"]) for t in texts), out


PEERS = {"dynalm": run_dynalm, "llama.cpp": run_llama_cpp, "torch": run_torch}


def torch_label() -> str:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return "transformers+pooling (no sentence-transformers)"
    return "sentence-transformers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=MAX_SEQ_LENGTH)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--type", choices=("f32", "f16", "q8_0"), default="f32")
    parser.add_argument("--mode", default="auto", help="DynaLM's --mode")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "embed_bench")
    parser.add_argument("--peer", help=argparse.SUPPRESS)  # internal: run one peer
    args = parser.parse_args()
    args.folder = args.cache / "minilm-l6-st"
    args.gguf = args.cache / f"minilm-l6.{args.type}.gguf"
    texts = make_inputs(args.inputs, args.min_tokens, args.max_tokens, args.seed)
    if args.peer:
        seconds, tokens, vectors = PEERS[args.peer](args, texts)
        np.save(args.cache / f"vectors.{args.peer}.npy", vectors)
        print(json.dumps({"seconds": seconds, "tokens": tokens}))
        return
    peers = [p.strip() for p in args.peers.split(",")]
    if unknown := set(peers) - PEERS.keys():
        parser.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEERS)}")
    write_model(args.folder, args.gguf, args.type)
    results = {}
    for peer in peers:
        cmd = [sys.executable, __file__, "--peer", peer, *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if done.returncode:
            print(f"{peer}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results[peer] = json.loads(done.stdout.strip().splitlines()[-1])
    labels = {"dynalm": f"DynaLM (--mode {args.mode})",
              "llama.cpp": "llama.cpp (llama-cpp-python embedding=True)",
              "torch": f"torch: {torch_label()}"}  # fmt: skip
    what = f"{args.threads} threads, {args.type.upper()} weights, all-MiniLM-L6 shape"
    print(f"\n{args.inputs} inputs of {args.min_tokens}-{args.max_tokens} tokens, {what}\n")
    print(f"| {'peer':<54} | inputs/s | tokens/s |  time s | DynaLM x | min cos vs DynaLM |")
    print(f"|{'-' * 56}|---------:|---------:|--------:|---------:|------------------:|")
    base = results.get("dynalm")
    ref = np.load(args.cache / "vectors.dynalm.npy") if base else None
    for peer, r in results.items():
        speedup = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        cos = "-"
        if ref is not None:
            v = np.load(args.cache / f"vectors.{peer}.npy")
            c = (v * ref).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(ref, axis=1)
            cos = f"{c.min():.6f}"
        print(f"| {labels[peer]:<54} | {args.inputs / r['seconds']:8.1f} | "
              f"{r['tokens'] / r['seconds']:8.0f} | {r['seconds']:7.2f} | {speedup:>8} | "
              f"{cos:>17} |")  # fmt: skip


if __name__ == "__main__":
    main()
