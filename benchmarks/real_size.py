"""Random-weight GGUFs at the shapes people run (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B,
Qwen2.5-1.5B with its q/k/v biases), quantised by llama.cpp's own quantiser, and
``dynalm bench --vs llama.cpp`` on each: the real-size table of the README.

    python benchmarks/real_size.py [--models 1b,3b] [--formats q4_0,q4_k_m] [--write-only]
        [-- BENCH ARGS]      # default: -p 512 -n 128 -r 3 -t 2

Each model is written once as F16 (weights ~ N(0, 0.02), norms 1), with SmolLM2's
tokenizer padded with unused tokens to the family's real vocabulary (128,256 for Llama 3,
151,936 for Qwen2.5: the output head is a fifth of a 1B model's bytes), then quantised
with ``llama_cpp.llama_model_quantize`` (the ``dynalm[bench]`` extra) into each format;
the F16 file is deleted once its formats exist. Files live in ``.cache/real_size/``
(git-ignored) and are reused. Random weights give meaningless text but real speed: the
kernels' work does not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from kquant_table import FTYPES, census, quantize

ROOT = Path(__file__).resolve().parents[1]
BENCH_ARGS = ["-p", "512", "-n", "128", "-r", "3", "-t", "2"]


@dataclass(frozen=True)
class ModelShape:
    arch: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    tied: bool  # output head = token embedding
    bias: bool = False  # q/k/v biases (qwen2)
    rope_base: float = 500000.0
    ctx: int = 131072
    n_experts: int = 0  # > 0: a mixture of experts, each of d_ff (ffn_*_exps stacked)
    n_experts_used: int = 0  # top k per token
    qk_norm: bool = False  # RMS norms over the whole q and k widths (olmoe)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape) of every tensor, in file order."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, self.d_model))]
        for i in range(self.n_layers):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (self.d_model,)),
                (b + "attn_q.weight", (q, self.d_model)),
                (b + "attn_k.weight", (kv, self.d_model)),
                (b + "attn_v.weight", (kv, self.d_model)),
            ]
            if self.bias:
                out += [(b + f"attn_{x}.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
            out += [
                (b + "attn_output.weight", (self.d_model, q)),
            ]
            if self.qk_norm:
                out += [(b + "attn_q_norm.weight", (q,)), (b + "attn_k_norm.weight", (kv,))]
            out.append((b + "ffn_norm.weight", (self.d_model,)))
            if self.moe:  # numpy order [n_expert, rows, cols], as llama.cpp stacks experts
                e = self.n_experts
                out += [
                    (b + "ffn_gate_inp.weight", (e, self.d_model)),
                    (b + "ffn_gate_exps.weight", (e, self.d_ff, self.d_model)),
                    (b + "ffn_up_exps.weight", (e, self.d_ff, self.d_model)),
                    (b + "ffn_down_exps.weight", (e, self.d_model, self.d_ff)),
                ]
            else:
                out += [
                    (b + "ffn_gate.weight", (self.d_ff, self.d_model)),
                    (b + "ffn_up.weight", (self.d_ff, self.d_model)),
                    (b + "ffn_down.weight", (self.d_model, self.d_ff)),
                ]
        out.append(("output_norm.weight", (self.d_model,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, self.d_model)))
        return out


MODELS = {
    "1b": ModelShape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "3b": ModelShape("llama", 3072, 28, 24, 8, 8192, 128256, tied=True),
    "8b": ModelShape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    "qwen2-1.5b": ModelShape(
        "qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, bias=True, rope_base=1e6
    ),
    # allenai/OLMoE-1B-7B-0924: 64 experts of ff 1024, 8 per token (weights not renormalised)
    "olmoe-1b-7b": ModelShape(
        "olmoe",
        2048,
        16,
        16,
        16,
        1024,
        50304,
        tied=False,
        rope_base=1e4,
        ctx=4096,
        n_experts=64,
        n_experts_used=8,
        qk_norm=True,
    ),
}


def _tokenizer_fields(source: Path) -> dict[str, gguf.ReaderField]:
    reader = gguf.GGUFReader(source)
    return {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _add_tokenizer(w: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    """SmolLM2's BPE tokenizer, its token list padded with unused tokens to ``vocab``."""
    fields = _tokenizer_fields(source)
    tokens = list(fields.pop("tokenizer.ggml.tokens").contents())
    types = list(fields.pop("tokenizer.ggml.token_type").contents())
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, field in fields.items():
        value, vtype = field.contents(), field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif key != "tokenizer.chat_template":
            w.add_key_value(key, value, vtype)
    w.add_chat_template(fields["tokenizer.chat_template"].contents())


def write_f16(shape: ModelShape, source: Path, out: Path) -> None:
    """The model as F16 (norms and biases F32), streamed tensor by tensor to ``out``."""
    partial = out.with_suffix(".partial")
    w = gguf.GGUFWriter(partial, shape.arch)
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.ctx)
    w.add_embedding_length(shape.d_model)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    if shape.moe:
        w.add_expert_count(shape.n_experts)
        w.add_expert_used_count(shape.n_experts_used)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    _add_tokenizer(w, source, shape.vocab)
    tensors = shape.tensors()
    # F32 where llama.cpp's converter keeps it (norms, biases, the MoE router), else F16
    dtypes = {
        name: np.dtype(np.float32 if len(dims) == 1 or "gate_inp" in name else np.float16)
        for name, dims in tensors
    }
    for name, dims in tensors:
        w.add_tensor_info(name, dims, dtypes[name], int(np.prod(dims)) * dtypes[name].itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    total = len(tensors)
    for i, (name, dims) in enumerate(tensors):
        if len(dims) == 1:
            data = np.ones(dims, np.float32) if "norm" in name else np.zeros(dims, np.float32)
        else:
            data = (rng.standard_normal(dims, np.float32) * 0.02).astype(dtypes[name])
        w.write_tensor_data(data)
        print(f"\r  writing {out.name}: tensor {i + 1}/{total}", end="", file=sys.stderr)
    print(file=sys.stderr)
    w.close()
    partial.rename(out)


def model_files(names: list[str], formats: list[str], cache: Path, source: Path) -> list[Path]:
    """The quantised files (written and quantised where missing), model by model."""
    cache.mkdir(parents=True, exist_ok=True)
    files = []
    for name in names:
        wanted = {fmt: cache / f"{name}-{fmt}.gguf" for fmt in formats}
        missing = [fmt for fmt, path in wanted.items() if not path.exists()]
        if missing:
            f16 = cache / f"{name}-f16.gguf"
            if not f16.exists():
                write_f16(MODELS[name], source, f16)
            for fmt in missing:
                print(f"  quantising {name} to {fmt} (llama.cpp)", file=sys.stderr)
                quantize(f16, wanted[fmt], fmt)
            f16.unlink()
        files += wanted.values()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1b,3b", help=", ".join(MODELS))
    parser.add_argument("--formats", default="q4_0,q4_k_m", help=", ".join(FTYPES))
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "real_size")
    parser.add_argument("--write-only", action="store_true", help="write the files, no bench")
    parser.add_argument("bench_args", nargs="*", help="after --: arguments for dynalm bench")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",")]
    formats = [f.strip() for f in args.formats.split(",")]
    if unknown := set(names) - MODELS.keys():
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    if unknown := set(formats) - FTYPES.keys():
        parser.error(f"unknown formats {sorted(unknown)}; choose from {', '.join(FTYPES)}")
    from dynalm.bench import file_decode_bytes
    from dynalm.store.catalog import ModelStore

    source = ModelStore().resolve("smollm2:135m")
    for path in model_files(names, formats, args.cache, source):
        size = path.stat().st_size / 2**20
        print(f"\n## {path.name} ({size:,.0f} MiB): {census(path)}", flush=True)
        print(file_decode_bytes(path).line(), flush=True)
        if args.write_only:
            continue
        dynalm = Path(sys.executable).with_name("dynalm")
        cmd = [
            str(dynalm),
            "bench",
            str(path),
            "--vs",
            "llama.cpp",
            *(args.bench_args or BENCH_ARGS),
        ]
        subprocess.run(cmd, check=False, env={**os.environ})


if __name__ == "__main__":
    main()
