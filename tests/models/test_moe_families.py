"""The mixtures of experts (qwen3moe, olmoe, mixtral: a llama with experts, and gpt-oss) beyond
`test_families`' logits, each a tiny random-weight model written as llama.cpp's converter
writes it (`tiny_models`):

* routing: the experts DynaLM's ``moe_route`` picks for every token of every layer are the
  ones transformers' router picks, with the same weights;
* a 64-token greedy continuation in ``exact`` is transformers' ``generate``'s, token for token;
* ``dynalm check`` passes on each family's ``.lum``, alone and against its file;
* the same model as a ``save_pretrained`` directory (one SafeTensors matrix per expert) runs
  on the same graph, its experts stacked without a copy (gpt-oss's stacks, gate and up
  interleaved, made one expert at a time in the converter's layout); gpt-oss's released
  layout too (MXFP4 blocks and scales, packed here from the format's definition, checked
  against transformers' dequantiser, read as GGUF MXFP4 blocks);
* a file whose experts disagree with its metadata is refused, naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_edit import Layout, V, value
from safetensors.numpy import load_file, save_file
from test_families import reference_logits
from tiny_models import (
    EOS_ID,
    MOE,
    N_EXPERTS,
    SPECS,
    VOCAB,
    TinySpec,
    gguf_arch,
    reference_model,
    write_gguf,
    write_hf_dir,
)
from transformers import PreTrainedModel

from dynalm.core import pool
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.matmul import CACHED_ROWS
from dynalm.core.quant import QUANT_FORMATS
from dynalm.errors import DynaError, ModelFormatError, UnsupportedModel
from dynalm.ir.lower import cpu as cpu_lower
from dynalm.ir.lower.cpu import expert_ffns
from dynalm.models import hf_dir, loader
from dynalm.models.arch import check_file, family_file
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.generator import Generator, generator_config
from tolerances import forward_bound, logit_scale

IDS: list[int] = np.random.default_rng(2028).integers(0, VOCAB, 20).tolist()
CONTINUATION, PROMPT = 64, 8
K_MAX = 128  # the longest summation of a block (qwen3moe's attention output, the head: 64)


@dataclasses.dataclass
class Case:
    spec: TinySpec
    reference: PreTrainedModel
    path: Path
    model: LoadedModel


@pytest.fixture(scope="module", params=MOE)
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Case]:
    spec = SPECS[request.param]
    reference = reference_model(spec)
    path = write_gguf(reference, spec, tmp_path_factory.mktemp("moe") / f"{spec.family}.gguf")
    model = load_model(path)
    yield Case(spec, reference, path, model)
    model.gguf.close()


def _generator(model: LoadedModel, mode: str) -> Generator:
    return Generator(Engine(model, CpuDevice(mode), generator_config(128)))


def reference_routes(reference: PreTrainedModel, ids: list[int]) -> list[tuple[np.ndarray, ...]]:
    """Per layer: transformers' router logits [T, E], chosen experts [T, k] (highest first)
    and their weights [T, k], recorded by a hook on each layer's router (``mlp.gate``,
    gpt-oss's ``mlp.router``: both give logits, weights, experts)."""
    found: list[tuple[np.ndarray, ...]] = []

    def record(module: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
        logits, weights, experts = out
        found.append((logits.numpy().copy(), experts.numpy().copy(), weights.numpy().copy()))

    routers = [
        getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in reference.model.layers
    ]
    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        with torch.no_grad():
            reference(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return found


def dynalm_routes(model: LoadedModel, mode: str, ids: list[int]) -> list[np.ndarray]:
    """Per layer, the value of its ``moe_route`` node [T, 2k] (ids, then weights): the
    model's own graph cut after that node, whose output is the route, run by the engine."""
    graph, routes = model.graph, []
    for i, node in enumerate(graph.nodes):
        if node.op != "moe_route":
            continue
        cut = dataclasses.replace(graph, nodes=graph.nodes[: i + 1], outputs={"logits": node.out})
        routes.append(_generator(dataclasses.replace(model, graph=cut), mode).forward(ids, True))
    return routes


@pytest.mark.parametrize("mode", ["safe", "exact"])
def test_tokens_go_to_the_experts_transformers_chooses(case: Case, mode: str) -> None:
    k = case.reference.config.num_experts_per_tok
    want = reference_routes(case.reference, IDS)
    got = dynalm_routes(case.model, mode, IDS)
    assert len(got) == len(want) == case.spec.n_layers
    for layer, (route, (logits, experts, weights)) in enumerate(zip(got, want, strict=True)):
        # the logits' rounding (two fp32 passes through `layer` blocks) must not decide a
        # choice, or the comparison would test rounding: the k-th and (k+1)-th logits of
        # every token lie further apart than it
        bound = forward_bound(layer + 1, K_MAX, logit_scale(logits))[:, 0]
        ranked = -np.sort(-logits, axis=1)
        assert (ranked[:, k - 1] - ranked[:, k] > 2 * bound).all(), f"layer {layer}: a near tie"
        assert route.shape == (len(IDS), 2 * k)
        assert len(np.unique(experts)) >= N_EXPERTS // 2, "too few experts used to test routing"
        assert (route[:, :k] == experts).all(), f"layer {layer}: {route[:, :k]} != {experts}"
        # the weights' softmax moves each by at most twice its logits' error (relative),
        # renormalising by as much again
        assert np.abs(route[:, k:] - weights).max() <= 4 * bound.max(), f"layer {layer}"


def test_exact_greedy_continuation_is_transformers(case: Case) -> None:
    prompt = IDS[:PROMPT]
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = case.reference.generate(
            x,
            max_new_tokens=CONTINUATION,
            min_new_tokens=CONTINUATION,
            do_sample=False,
            attention_mask=torch.ones_like(x),
            pad_token_id=EOS_ID,
            eos_token_id=None,
        )
    want = out[0, PROMPT:].tolist()
    assert len(want) == CONTINUATION
    assert len(set(want)) >= 8, f"a degenerate continuation proves little: {want}"
    greedy = SamplingParams(max_tokens=CONTINUATION, temperature=0, repeat_penalty=1.0)
    gen = _generator(case.model, "exact")
    got = [
        e.token for e in gen.generate(prompt, greedy, stop_ids=frozenset()) if e.token is not None
    ]
    assert got == want


def test_decode_steps_run_natively_as_the_python_path_does(case: Case) -> None:
    """A one-token step compiles to one native program (the route, the naming of its
    experts, their matmuls, the combine: no Python between its layers), and gives the
    tokens the same steps give run op by op from Python (the executor's profiled path),
    also for a second prompt after decoding (a longer step among compiled one-token ones,
    whose route runs natively too)."""
    greedy = SamplingParams(max_tokens=12, temperature=0, repeat_penalty=1.0)
    native, python = _generator(case.model, "auto"), _generator(case.model, "auto")
    python.engine.executor.profile = {}  # every op called from Python, one by one
    for prompt in (IDS[:PROMPT], IDS[PROMPT:]):
        runs = [
            [
                e.token
                for e in gen.generate(prompt, greedy, stop_ids=frozenset())
                if e.token is not None
            ]
            for gen in (native, python)
        ]
        assert runs[0] == runs[1]
        # the last (one-token) step's submission: the embedding lookup (rows dequantised
        # on demand, from Python), then every layer and the head as one native program
        steps = native.engine.executor._steps
        assert len(steps) == 2 and isinstance(steps[1], pool.Program), steps


def test_sequences_decoding_together_get_their_tokens_alone(case: Case) -> None:
    """Three sequences decoding in one batch (steps of up to three tokens: native records,
    a GEMV per (token, slot) pair) get the tokens each gets alone, to the bit: a row's
    product does not depend on what else the step holds."""
    prompts = [IDS[:6], IDS[6:14], IDS[14:]]
    greedy = SamplingParams(max_tokens=10, temperature=0, repeat_penalty=1.0)
    alone = _generator(case.model, "auto")
    want = [
        [e.token for e in alone.generate(p, greedy, stop_ids=frozenset()) if e.token is not None]
        for p in prompts
    ]
    config = dataclasses.replace(generator_config(128), max_num_seqs=3)
    engine = Engine(case.model, CpuDevice("auto"), config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy, stop_ids=frozenset())
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert [got[str(i)] for i in range(3)] == want


def test_check_passes_on_the_family_file(case: Case) -> None:
    lum = family_file(case.model.hparams.arch)
    assert lum.name == {"mixtral": "llama.lum"}.get(case.spec.family, f"{case.spec.family}.lum")
    assert check_file(lum).startswith(f"{lum}: ok")
    summary = check_file(lum, case.path)
    assert summary.endswith("nodes") and f"{case.path}: a graph of " in summary


def _matches_transformers(case: Case, model: LoadedModel) -> None:
    """The directory's model gives transformers' logits (within the bound, top-1 equal, in
    safe and exact), its tokens transformers' experts, and the GGUF's shapes."""
    assert model.hparams.arch == gguf_arch(case.spec)
    for name, info in case.model.gguf.tensors.items():
        assert model.gguf.tensors[name].shape == info.shape, name
    want = reference_logits(case.reference, IDS)
    for mode in ("safe", "exact"):
        got = _generator(model, mode).forward(IDS, all_logits=True)
        ratio = np.abs(got - want) / forward_bound(case.spec.n_layers, K_MAX, logit_scale(want))
        assert ratio.max() <= 1, f"{mode}: {ratio.max():.3g} of the bound"
        assert (got.argmax(1) == want.argmax(1)).all()
    routes = dynalm_routes(model, "exact", IDS)
    k = case.reference.config.num_experts_per_tok
    for route, (_, experts, _) in zip(routes, reference_routes(case.reference, IDS), strict=True):
        assert (route[:, :k] == experts).all()


@pytest.mark.parametrize("case", MOE, indirect=True)
def test_safetensors_directory_matches_transformers(case: Case, tmp_path: Path) -> None:
    path = write_hf_dir(case.reference, tmp_path / case.spec.family)
    model = load_model(path)
    try:
        gate = model.gguf.tensors["blk.1.ffn_gate_exps.weight"]
        stacked = model.gguf.raw("blk.1.ffn_gate_exps.weight")
        one = stacked[3]  # expert 3 alone: a view of its own tensor in the file
        assert one.shape == (gate.shape[1], 4 * gate.shape[2])
        if case.spec.family != "gpt-oss":  # (whose gate, every other column of its
            assert not one.flags.owndata  # gate_up_proj transposed, is made: a copy)
        np.testing.assert_array_equal(np.asarray(stacked)[3], one)
        _matches_transformers(case, model)
    finally:
        model.gguf.close()


# e2m1, MXFP4's element (OCP Microscaling spec): sign bit 3, exponent bits 2-1 (bias 1),
# mantissa bit 0; code 0b0001 is the subnormal 0.5
E2M1 = np.array(
    [s * m * 2.0**e for s in (1, -1) for e, m in [(0, 0), (0, 0.5), (0, 1), (0, 1.5)]
     + [(1, 1), (1, 1.5), (2, 1), (2, 1.5)]],
    np.float32,
)  # fmt: skip
E2M1_EMAX = 2  # the largest element's exponent (6 = 1.5 * 2**2)


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``[..., n]`` as the released checkpoints' MXFP4 ``(blocks [..., n/32, 16],
    scales [..., n/32])``, by the spec: a block's shared scale is ``2**(floor(log2(amax)) -
    emax)`` (an e8m0 byte, bias 127), each element the nearest e2m1 of ``x / scale``, packed
    two a byte, element 2j in the low nibble."""
    x = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(x).max(-1)
    assert (amax > 0).all(), "an all-zero block: no exponent"
    exponent = np.floor(np.log2(amax)) - E2M1_EMAX
    # (C order: safetensors' save_file writes an array's buffer as it lies in memory)
    scales = np.ascontiguousarray(exponent + 127, np.uint8)
    codes = np.abs(x[..., None] / 2.0 ** exponent[..., None, None] - E2M1).argmin(-1)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)
    return blocks, scales


def write_mxfp4_dir(reference: PreTrainedModel, path: Path) -> Path:
    """``reference`` as a released gpt-oss directory: its experts' stacks as MXFP4
    ``*_blocks`` / ``*_scales`` of the ``[E, out, in]`` matrices, config.json's
    quantization_config mxfp4; checks that transformers dequantises them to ``reference``'s
    weights (they are MXFP4 values already: `tiny_models`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = write_hf_dir(reference, path)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # [E, in, out]
        blocks, scales = mxfp4_pack(w.swapaxes(1, 2))
        back = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        )
        np.testing.assert_array_equal(back.numpy(), w, err_msg=name)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("case", ["gpt-oss"], indirect=True)
def test_a_released_gpt_oss_directory_runs_its_mxfp4_experts(case: Case, tmp_path: Path) -> None:
    model = load_model(write_mxfp4_dir(case.reference, tmp_path / "gpt-oss-mxfp4"))
    try:
        mxfp4 = QUANT_FORMATS[GGMLQuantizationType.MXFP4]
        experts = case.reference.model.layers[1].mlp.experts
        gate_up = experts.gate_up_proj.detach().numpy().swapaxes(1, 2)  # [E, 2 ff, d]
        want = {"gate": gate_up[:, 0::2], "up": gate_up[:, 1::2]}
        want["down"] = experts.down_proj.detach().numpy().swapaxes(1, 2)
        for proj, w in want.items():
            name = f"blk.1.ffn_{proj}_exps.weight"
            assert model.gguf.tensors[name].ggml_type == GGMLQuantizationType.MXFP4
            raw = np.asarray(model.gguf.raw(name)).reshape(-1, mxfp4.type_size)
            # GGUF MXFP4 blocks as DynaLM and gguf-py read them: the weights transformers runs
            np.testing.assert_array_equal(mxfp4.dequantize(raw).reshape(w.shape), w)
            by_gguf = gguf.quants.dequantize(raw, GGMLQuantizationType.MXFP4)
            np.testing.assert_array_equal(by_gguf.reshape(w.shape), w)
        _matches_transformers(case, model)
    finally:
        model.gguf.close()


# a gpt-oss directory's tensor missing or misshapen: (layout, tensor, its new shape or None
# to drop it, what the refusal says: hf_dir's for the experts, the graph's for the others,
# by their GGUF names)
BROKEN = [
    ("mxfp4", "model.layers.1.mlp.experts.down_proj_scales", None,
     "model.safetensors: no tensor 'model.layers.1.mlp.experts.down_proj_scales' "
     "(MXFP4 blocks and scales experts: [8, 64, 1] by config.json)"),
    ("mxfp4", "model.layers.0.mlp.experts.gate_up_proj_blocks", (8, 32, 2, 16),
     "model.safetensors: tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks' "
     "is U8 [8, 32, 2, 16], expected U8 [8, 64, 2, 16]"),
    ("dense", "model.layers.2.mlp.experts.gate_up_proj", (8, 64, 62),
     "model.safetensors: tensor 'model.layers.2.mlp.experts.gate_up_proj' "
     "is F32 [8, 64, 62], expected F32/F16/BF16 [8, 64, 64]"),
    ("dense", "model.layers.1.mlp.experts.gate_up_proj_bias", None,
     "model.safetensors: no tensor 'model.layers.1.mlp.experts.gate_up_proj_bias' "
     "(save_pretrained's experts: [8, 64] by config.json)"),
    ("mxfp4", "model.layers.1.self_attn.sinks", None,
     "the model has no tensor 'blk.1.attn_sinks.weight'"),
    ("dense", "model.layers.1.self_attn.sinks", (5,),
     "tensor 'blk.1.attn_sinks.weight' has shape [5], expected [4]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "name", "shape", "message"), BROKEN, ids=[f"{b[1]}-{b[2]}" for b in BROKEN]
)
def test_a_gpt_oss_directory_missing_a_tensor_is_refused(
    layout: str, name: str, shape: tuple[int, ...] | None, message: str, tmp_path: Path
) -> None:
    reference = reference_model(SPECS["gpt-oss"])
    write = write_mxfp4_dir if layout == "mxfp4" else write_hf_dir
    path = write(reference, tmp_path / layout)
    tensors = load_file(path / "model.safetensors")
    w = tensors.pop(name)
    if shape is not None:
        tensors[name] = np.resize(w, shape)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError) as refused:
        load_model(path)
    assert str(refused.value).startswith(str(path)), str(refused.value)
    assert message in str(refused.value), str(refused.value)


def test_a_directory_says_whether_the_weights_are_renormalised(tmp_path: Path) -> None:
    """Qwen3-MoE's ``norm_topk_prob`` false (llama.cpp's graph, and a GGUF, always
    renormalise): the directory's ``expert_weights_norm`` key tells qwen3moe.lum, and the
    logits follow transformers' unrenormalised router, far from the renormalised ones."""
    reference = reference_model(SPECS["qwen3moe"])
    renormalised = reference_logits(reference, IDS)
    reference.config.norm_topk_prob = False
    for layer in reference.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    want = reference_logits(reference, IDS)
    model = load_model(write_hf_dir(reference, tmp_path / "qwen3moe"))
    try:
        assert model.gguf.metadata["qwen3moe.expert_weights_norm"] is False
        got = _generator(model, "exact").forward(IDS, all_logits=True)
    finally:
        model.gguf.close()
    bound = forward_bound(2, K_MAX, logit_scale(want))
    assert (np.abs(got - want) / bound).max() <= 1
    assert (np.abs(renormalised - want) / bound).max() > 100


def test_a_directory_with_dense_layers_among_the_experts_is_refused(tmp_path: Path) -> None:
    path = write_hf_dir(reference_model(SPECS["qwen3moe"]), tmp_path / "qwen3moe")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [1]}))
    with pytest.raises(UnsupportedModel, match=r"config.json: dense layers among the experts"):
        load_model(path)


# (family, edit of the file, what the refusal says)
LIES = [
    ("qwen3moe", ("set", "qwen3moe.expert_used_count", 9),
     "qwen3moe.expert_used_count = 9 is not from 1 to qwen3moe.expert_count (8)"),
    ("mixtral", ("drop", "llama.expert_used_count"),
     "llama.expert_count = 8 but the metadata has no llama.expert_used_count"),
    ("olmoe", ("drop", "olmoe.expert_count"),
     "olmoe.expert_used_count = 2 is not 0: no experts (olmoe.expert_count absent or 0)"),
    # 4 experts claimed, 8 stored: the router's shape says so first
    ("mixtral", ("set", "llama.expert_count", 4), "blk.0.ffn_gate_inp.weight"),
    ("qwen3moe", ("set", "qwen3moe.expert_feed_forward_length", 64), "blk.0.ffn_gate_exps.weight"),
    # the same bytes as [8, 32, 64] read as [4, 64, 64] (ggml order: innermost first)
    ("olmoe", ("shape", "blk.1.ffn_up_exps.weight", [64, 64, 4]), "blk.1.ffn_up_exps.weight"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "edit", "message"), LIES, ids=[str(e[1:]) for _, e, _ in LIES])
def test_a_file_whose_experts_lie_is_refused(
    family: str, edit: tuple, message: str, tmp_path: Path
) -> None:
    spec = SPECS[family]
    path = write_gguf(reference_model(spec), spec, tmp_path / "true.gguf")
    layout = Layout.read(path)
    kind, name, *new = edit
    if kind == "set":
        layout = layout.set_value(name, value(V.UINT32, new[0]))
    elif kind == "drop":
        layout = layout.without(name)
    else:
        layout = layout.copy()
        next(i for i in layout.infos if i.name == name.encode()).ne = new[0]
    lie = layout.write(tmp_path / "lie.gguf")
    with pytest.raises(DynaError) as refused:
        load_model(lie)
    assert message in str(refused.value), str(refused.value)


def _gpt_oss_config_edit(path: Path, edit: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))


def test_a_released_gpt_oss_config_gives_the_converters_keys(tmp_path: Path) -> None:
    """gpt-oss-20b's config.json as released (transformers 4's top-level ``rope_theta`` and
    ``rope_scaling``, YaRN's ``truncate`` false, its ``experts_per_token``) gives the keys
    the directory's transformers 5 config gives, which are the converter's."""
    path = write_hf_dir(reference_model(SPECS["gpt-oss"]), tmp_path / "gpt-oss")
    with load_model(path).gguf as now:
        want = {k: v for k, v in now.metadata.items() if k.startswith("gpt-oss.")}
    assert want["gpt-oss.rope.scaling.type"] == "yarn"
    assert want["gpt-oss.attention.sliding_window"] == SPECS["gpt-oss"].sliding_window
    config = json.loads((path / "config.json").read_text())
    yarn = {k: v for k, v in config.pop("rope_parameters").items() if k != "rope_theta"}
    released = config | dict(rope_theta=SPECS["gpt-oss"].rope_theta, experts_per_token=2)
    released["rope_scaling"] = yarn | {"truncate": False}
    (path / "config.json").write_text(json.dumps(released))
    with load_model(path).gguf as then:
        assert {k: v for k, v in then.metadata.items() if k.startswith("gpt-oss.")} == want


# a gpt-oss config.json's traits gpt-oss.lum (as llama.cpp's graph) fixes: (edit, refusal)
UNLIKE = [
    ({"swiglu_limit": 10.0}, "swiglu_limit = 10.0 is not supported (gpt-oss's 7.0"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types ['full_attention', 'full_attention'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                          "original_max_position_embeddings": 64}},
     "YaRN's mscale not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "message"), UNLIKE, ids=[next(iter(e)) for e, _ in UNLIKE])
def test_a_gpt_oss_config_unlike_the_graph_is_refused(
    edit: dict, message: str, tmp_path: Path
) -> None:
    path = write_hf_dir(reference_model(SPECS["gpt-oss"]), tmp_path / "gpt-oss")
    _gpt_oss_config_edit(path, edit)
    with pytest.raises(UnsupportedModel) as refused:
        load_model(path)
    assert f"{path / 'config.json'}: {message}" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("case", "layout"), [("qwen3moe", "dense"), ("gpt-oss", "mxfp4")], indirect=["case"]
)
def test_a_directorys_experts_are_mapped_from_the_repack_cache(
    case: Case, layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory's experts (one SafeTensors matrix each, or gpt-oss's MXFP4 stacks, made
    one expert at a time) repacked once: a later load maps each routed expert and gives the
    same tokens; a change to the code that makes the stacks' bytes makes them anew."""
    monkeypatch.setenv("DYNALM_REPACK_CACHE", str(tmp_path / "repack"))
    monkeypatch.setattr(loader, "RACY_SECONDS", -1.0)  # the shards were written just now
    write = write_mxfp4_dir if layout == "mxfp4" else write_hf_dir
    path = write(case.reference, tmp_path / case.spec.family)
    greedy = SamplingParams(max_tokens=8, temperature=0, repeat_penalty=1.0)

    def run() -> tuple[list[int], int, int]:
        model = load_model(path)
        try:
            device = CpuDevice("auto")
            gen = Generator(Engine(model, device, generator_config(128)))
            out = gen.generate(IDS[:PROMPT], greedy, stop_ids=frozenset())
            return [e.token for e in out if e.token is not None], device.repacked, device.mapped
        finally:
            model.gguf.close()

    tokens, repacked, _ = run()
    assert repacked > 3 * N_EXPERTS  # (each layer's routed experts: most of its 8, x 3)
    again, none, mapped = run()
    assert again == tokens and none == 0 and mapped == repacked
    if layout == "mxfp4":
        monkeypatch.setattr(hf_dir, "_made_version", lambda: "another maker")
        _, remade, kept = run()
        experts = remade  # the made experts only: the attention's weights are read as stored
        assert 0 < experts < repacked and kept == repacked - experts


def test_an_expert_ffn_keeps_its_rows_in_expert_order(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill too long to run natively keeps each FFN's rows in expert order between its
    matmuls (``expert_ffns``: gate and up write them so, the gated op reads them, down
    reads them so): the logits bitwise those of every row in token order."""
    tokens = np.random.default_rng(7).integers(0, VOCAB, CACHED_ROWS + 36).tolist()  # (ctx 128)
    graph = _generator(case.model, "auto").engine.executor.binder.graph
    sorted_x, sorted_out = expert_ffns(graph)
    assert len(sorted_x) == case.model.hparams.n_layers and len(sorted_out) == 2 * len(sorted_x)
    for mode in ("auto", "exact"):
        ordered = _generator(case.model, mode).forward(tokens, all_logits=True)
        monkeypatch.setattr(cpu_lower, "expert_ffns", lambda graph: (set(), set()))
        plain = _generator(case.model, mode).forward(tokens, all_logits=True)
        monkeypatch.undo()
        np.testing.assert_array_equal(ordered, plain, err_msg=mode)
