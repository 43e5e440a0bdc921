"""`dynalm.bench.file_decode_bytes`: what a decode step reads of a GGUF, per part; of a
mixture of experts, only the top-k experts of each stacked ``ffn_*_exps`` tensor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from dynalm.bench import file_decode_bytes

D, FF, VOCAB, E, K = 32, 16, 64, 8, 2


def _write(path: Path, tensors: dict[str, tuple[int, ...]], experts: bool, tied: bool) -> None:
    w = gguf.GGUFWriter(path, "olmoe")
    if experts:
        w.add_expert_count(E)
        w.add_expert_used_count(K)
    if not tied:
        tensors = {**tensors, "output.weight": (VOCAB, D)}
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


COMMON = {
    "token_embd.weight": (VOCAB, D),
    "blk.0.attn_norm.weight": (D,),
    "blk.0.attn_q.weight": (D, D),
    "blk.0.attn_q_norm.weight": (D,),
    "blk.0.ffn_norm.weight": (D,),
    "output_norm.weight": (D,),
}
MOE = {
    "blk.0.ffn_gate_inp.weight": (E, D),
    "blk.0.ffn_gate_exps.weight": (E, FF, D),
    "blk.0.ffn_up_exps.weight": (E, FF, D),
    "blk.0.ffn_down_exps.weight": (E, D, FF),
}
DENSE = {"blk.0.ffn_up.weight": (FF, D), "blk.0.ffn_down.weight": (D, FF)}


def test_a_mixture_reads_its_selected_experts(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    _write(path, COMMON | MOE, experts=True, tied=False)
    read = file_decode_bytes(path)
    f32 = 4
    experts = 3 * E * FF * D * f32
    assert read.parts == {
        "attention": D * D * f32,
        "other": 4 * D * f32,  # the four norms
        "router": E * D * f32,
        "experts": experts,
        "head": VOCAB * D * f32,  # output.weight; the embedding's row is not counted
    }
    assert (read.top_k, read.n_experts) == (K, E)
    assert read.experts == experts * K // E
    assert read.dense - read.per_token == experts - experts * K // E
    line = read.line()
    assert f"{K} of {E} experts per layer" in line and "dense equivalent" in line


def test_a_dense_file_reads_everything_but_the_embedding(tmp_path: Path) -> None:
    path = tmp_path / "dense.gguf"
    _write(path, COMMON | DENSE, experts=False, tied=True)
    read = file_decode_bytes(path)
    assert read.n_experts == 0 and read.experts == 0
    assert read.per_token == read.dense
    assert read.parts["head"] == VOCAB * D * 4  # tied: the embedding is the head
    assert read.parts["ffn"] == 2 * FF * D * 4
    assert "experts" not in read.line()
