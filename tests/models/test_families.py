"""Fidelity per family: tiny random-weight GGUFs (llama, qwen2, gemma3, and qwen3, olmo2 and
the mixtures of experts qwen3moe, olmoe, mixtral and gpt-oss, whose only source in DynaLM is
their ``.lum`` file) give the same logits as transformers' own implementation of that family, in
fp32 and with Q8_0 weights (`test_moe` checks the experts' routing itself).

Each model is written the way llama.cpp's converter writes that family (see `tiny_models`),
loaded with `load_model` and run by the `Generator` in ``safe`` and ``exact`` modes: every
position of a 20-token input in one pass, and the same input as a 12-token prefill followed
by 8 single-token steps on the paged KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_edit import Layout, V, value
from tiny_models import (
    MOE,
    MXFP4,
    N_EXPERTS,
    SPECS,
    VOCAB,
    TinySpec,
    dequantize_weights,
    gguf_arch,
    reference_model,
    write_gguf,
)
from transformers import PreTrainedModel

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import UnsupportedModel
from dynalm.models.arch import check_file, family_file
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.generator import Generator, generator_config
from tolerances import forward_bound, logit_scale

FAMILIES = sorted(SPECS)
MODES = ("safe", "exact")
TOL = 1.0  # of `_max_diff`'s bound
N_TOKENS, N_PREFILL = 20, 12
IDS: list[int] = np.random.default_rng(1234).integers(0, VOCAB, N_TOKENS).tolist()


@dataclasses.dataclass
class Case:
    spec: TinySpec
    reference: PreTrainedModel
    ref_logits: np.ndarray  # [N_TOKENS, VOCAB]
    model: LoadedModel


def reference_logits(model: PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float32).numpy()


def _case(spec: TinySpec, path: Path, qtype: GGMLQuantizationType) -> Case:
    reference = reference_model(spec)
    write_gguf(reference, spec, path, qtype)
    if qtype != GGMLQuantizationType.F32:
        dequantize_weights(reference, qtype)
    return Case(spec, reference, reference_logits(reference, IDS), load_model(path))


@pytest.fixture(scope="module", params=FAMILIES)
def f32_case(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Case]:
    family: str = request.param
    path = tmp_path_factory.mktemp("tiny") / f"{family}-f32.gguf"
    case = _case(SPECS[family], path, GGMLQuantizationType.F32)
    yield case
    case.model.gguf.close()


def _ratio(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| as a fraction of the rounding two fp32 forward passes of a tiny model
    may differ by (`tolerances.forward_bound`, each position's largest |logit|)."""
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    bound = forward_bound(max(s.n_layers for s in SPECS.values()), 128, logit_scale(want))
    return np.abs(got - want) / bound


def _max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(_ratio(got, want).max())


def _all_positions(model: LoadedModel, mode: str) -> np.ndarray:
    gen = Generator(Engine(model, CpuDevice(mode), generator_config(64)))
    return gen.forward(IDS, all_logits=True)


def _continued(model: LoadedModel, mode: str) -> np.ndarray:
    """Prefill the first N_PREFILL tokens, then feed the rest one at a time over the cache."""
    gen = Generator(Engine(model, CpuDevice(mode), generator_config(64)))
    rows = [gen.forward(IDS[:N_PREFILL], all_logits=True)]
    rows += [gen.forward([tok])[None] for tok in IDS[N_PREFILL:]]
    return np.concatenate(rows)


def test_gguf_is_written_like_llama_cpp(f32_case: Case) -> None:
    spec, model, cfg = f32_case.spec, f32_case.model, f32_case.reference.config
    hp = model.hparams
    assert hp.arch == gguf_arch(spec)
    assert (hp.n_layers, hp.d_model, hp.d_ff) == (spec.n_layers, 64, cfg.intermediate_size)
    assert (hp.n_heads, hp.n_kv_heads, hp.head_dim) == (4, cfg.num_key_value_heads, 16)
    assert hp.rope_base == spec.rope_theta
    assert hp.sliding_window == spec.sliding_window
    assert hp.rope_scaling == ("yarn" if spec.family == "gpt-oss" else "none")
    assert ("output.weight" in model.gguf.tensors) == (not spec.tied)
    assert ("blk.0.attn_q.bias" in model.gguf.tensors) == (spec.family in ("qwen2", "gpt-oss"))
    assert model.tokenizer.decode(model.tokenizer.encode("héllo!", add_special=False)) == "héllo!"
    shapes = {name: t.shape for name, t in model.gguf.tensors.items()}
    assert ("blk.0.ffn_up.weight" in shapes) == (spec.family not in MOE)
    if spec.family in MOE:  # numpy order: [expert, rows, cols]
        ff = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
        assert shapes["blk.0.ffn_gate_inp.weight"] == (N_EXPERTS, 64)
        assert shapes["blk.0.ffn_gate_exps.weight"] == (N_EXPERTS, ff, 64)
        assert shapes["blk.0.ffn_up_exps.weight"] == (N_EXPERTS, ff, 64)
        assert shapes["blk.0.ffn_down_exps.weight"] == (N_EXPERTS, 64, ff)


@pytest.mark.parametrize("mode", MODES)
def test_all_positions_match_transformers(f32_case: Case, mode: str) -> None:
    diff = _max_diff(_all_positions(f32_case.model, mode), f32_case.ref_logits)
    assert diff <= TOL, f"{f32_case.spec.family} ({mode}): max |diff| {diff:.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_kv_cache_continuation_matches_transformers(f32_case: Case, mode: str) -> None:
    diff = _max_diff(_continued(f32_case.model, mode), f32_case.ref_logits)
    assert diff <= TOL, f"{f32_case.spec.family} ({mode}): max |diff| {diff:.3g}"


def test_exact_mode_picks_the_same_top_token_as_transformers(f32_case: Case) -> None:
    got = _all_positions(f32_case.model, "exact")
    assert (got.argmax(axis=1) == f32_case.ref_logits.argmax(axis=1)).all()


def test_gemma3_exercises_local_and_global_layers() -> None:
    """The gemma3 case is only a test of the sliding window if the window changes the logits."""
    spec = SPECS["gemma3"]
    reference = reference_model(spec)
    types = reference.config.layer_types
    assert types[5] == "full_attention"
    assert all(t == "sliding_attention" for i, t in enumerate(types) if i != 5)
    assert reference.config.query_pre_attn_scalar == reference.config.head_dim
    windowed = reference_logits(reference, IDS)
    wide = reference_model(dataclasses.replace(spec, sliding_window=N_TOKENS))
    unwindowed = reference_logits(wide, IDS)
    w = spec.sliding_window
    assert _max_diff(windowed[:w], unwindowed[:w]) <= TOL
    assert _ratio(windowed[w:], unwindowed[w:]).max(axis=1).min() > 100 * TOL


def test_gemma2_soft_capping_and_window_bind() -> None:
    """The gemma2 case tests the caps and the window only if each changes the logits:
    without the score cap, without the logit cap, and with a window as wide as the input
    (the first ``w`` positions see no further back either way)."""
    spec = SPECS["gemma2"]
    reference = reference_model(spec)
    local, full = "sliding_attention", "full_attention"
    assert reference.config.layer_types == [local, full, local]
    capped = reference_logits(reference, IDS)
    w = spec.sliding_window
    # (position 0 attends to itself alone, whatever its score: from w on, with w keys)
    for change, first in (({"attn_softcap": 0.0}, w), ({"final_softcap": 0.0}, 0)):
        uncapped = reference_logits(reference_model(dataclasses.replace(spec, **change)), IDS)
        assert _ratio(capped[first:], uncapped[first:]).max(axis=1).min() > 100 * TOL, change
    wide = reference_model(dataclasses.replace(spec, sliding_window=N_TOKENS))
    wide = reference_logits(wide, IDS)
    assert _max_diff(capped[:w], wide[:w]) <= TOL
    assert _ratio(capped[w:], wide[w:]).max(axis=1).min() > 100 * TOL


# issue 28's: a greedy continuation picked as transformers does
GREEDY_FAMILIES = ("gemma2", "phi3", "phi3-longrope")
N_GREEDY = 64


def test_phi3_longrope_reads_the_factors_of_its_context(tmp_path: Path) -> None:
    """llama.cpp's rule: a context (--ctx) past the trained one (16 positions here) reads
    the long factors, else the short ones; transformers picks by the length of the input.
    So 12 tokens with --ctx 16 give transformers' logits of those 12 tokens alone (short
    factors), and with --ctx 64 the first 12 rows of its 20-token pass (long factors); the
    two differ, or the test would prove nothing."""
    case = _case(SPECS["phi3-longrope"], tmp_path / "phi3.gguf", GGMLQuantizationType.F32)
    try:
        assert case.model.hparams.n_ctx_train == 256
        short = reference_logits(case.reference, IDS[:N_PREFILL])
        long = case.ref_logits[:N_PREFILL]
        assert _ratio(short, long).max(axis=1)[2:].min() > 100 * TOL
        for ctx, want in ((16, short), (64, long)):
            gen = Generator(Engine(case.model, CpuDevice("exact"), generator_config(ctx)))
            diff = _max_diff(gen.forward(IDS[:N_PREFILL], all_logits=True), want)
            assert diff <= TOL, f"--ctx {ctx}: max |diff| {diff:.3g}"
    finally:
        case.model.gguf.close()


@pytest.mark.parametrize("family", GREEDY_FAMILIES)
def test_dynalm_check_passes_on_the_family_file(family: str, tmp_path: Path) -> None:
    """What ``dynalm check FILE.lum --gguf MODEL`` runs: the file parses, checks and
    elaborates against a GGUF written as llama.cpp's converter writes the family."""
    spec = SPECS[family]
    path = write_gguf(reference_model(spec), spec, tmp_path / "m.gguf")
    lum = family_file(spec.family)
    summary = check_file(lum, path)
    assert summary.startswith(f"{lum}: ok (family {spec.family}")
    assert "a graph of" in summary


@pytest.mark.parametrize("family", GREEDY_FAMILIES)
def test_exact_greedy_continuation_matches_transformers(family: str, tmp_path: Path) -> None:
    """64 greedy tokens after the input, one decode step each over the paged KV cache in
    ``exact``: each is transformers' top token on the same prefix, and every step's logits
    are within the fp32 bound of transformers' (one pass over the whole sequence)."""
    case = _case(SPECS[family], tmp_path / f"{family}.gguf", GGMLQuantizationType.F32)
    try:
        gen = Generator(Engine(case.model, CpuDevice("exact"), generator_config(128)))
        rows = [gen.forward(IDS)]
        for _ in range(N_GREEDY - 1):
            rows.append(gen.forward([int(rows[-1].argmax())]))
        got = np.stack(rows)
        tokens = IDS + [int(r.argmax()) for r in rows]
        want = reference_logits(case.reference, tokens[:-1])[N_TOKENS - 1 :]
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
        diff = _max_diff(got, want)
        assert diff <= TOL, f"{family}: max |diff| {diff:.3g} over {N_GREEDY} greedy steps"
    finally:
        case.model.gguf.close()


def test_gpt_oss_exercises_sinks_windows_and_yarn() -> None:
    """The gpt-oss case tests its sinks, its sliding window and its YaRN only if each
    changes transformers' logits: without sinks (a logit of -1e9: no weight), with a window
    past the input, with plain rope, they lie far outside the bound."""
    spec = SPECS["gpt-oss"]
    reference = reference_model(spec)
    assert reference.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert reference.model.rotary_emb.rope_type == "yarn"
    want = reference_logits(reference, IDS)
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
    assert _max_diff(reference_logits(reference, IDS), want) > 100 * TOL
    wide = reference_model(dataclasses.replace(spec, sliding_window=N_TOKENS))
    assert _max_diff(reference_logits(wide, IDS), want) > 100 * TOL
    plain = reference_model(spec)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": spec.rope_theta}
    plain.model.rotary_emb = type(plain.model.rotary_emb)(plain.config)
    assert _max_diff(reference_logits(plain, IDS), want) > 100 * TOL


def test_yarn_is_refused_where_the_family_does_not_apply_it(tmp_path: Path) -> None:
    """A llama file saying rope.scaling.type yarn: llama.lum's rope has no YaRN, and the
    file is refused rather than run with a linear scale."""
    spec = SPECS["llama"]
    path = write_gguf(reference_model(spec), spec, tmp_path / "llama.gguf")
    layout = Layout.read(path).set_value("llama.rope.scaling.type", value(V.STRING, "yarn"))
    layout = layout.set_value("llama.rope.scaling.factor", value(V.FLOAT32, 4.0))
    with pytest.raises(UnsupportedModel, match="yarn .factor 4. is not supported for archi"):
        load_model(layout.write(tmp_path / "yarn.gguf"))


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_matches_dequantised_reference(family: str, tmp_path: Path) -> None:
    q8 = GGMLQuantizationType.Q8_0
    case = _case(SPECS[family], tmp_path / f"{family}-q8_0.gguf", q8)
    try:
        types = {name: t.ggml_type for name, t in case.model.gguf.tensors.items()}
        assert types["token_embd.weight"] == q8
        if family in MOE:  # the experts quantised, their router not (as the converter)
            experts = MXFP4 if family == "gpt-oss" else q8  # as released, whatever the type
            assert types["blk.0.ffn_down_exps.weight"] == experts
            assert types["blk.0.ffn_gate_inp.weight"] == GGMLQuantizationType.F32
        else:
            assert types["blk.0.ffn_down.weight"] == q8
        assert types["output_norm.weight"] == GGMLQuantizationType.F32
        # the rounding must matter, or matching the rounded reference proves nothing
        unrounded = reference_logits(reference_model(SPECS[family]), IDS)
        assert _max_diff(unrounded, case.ref_logits) > 100 * TOL
        for mode in MODES:
            diff = _max_diff(_all_positions(case.model, mode), case.ref_logits)
            assert diff <= TOL, f"{family} q8_0 ({mode}): max |diff| {diff:.3g}"
            diff = _max_diff(_continued(case.model, mode), case.ref_logits)
            assert diff <= TOL, f"{family} q8_0 continued ({mode}): max |diff| {diff:.3g}"
    finally:
        case.model.gguf.close()
