"""Every family of the tiny models (``tiny_models.SPECS``) on the CUDA device without a GPU:
the emulated driver (``cuda_emulator``) runs the NVPTX backend's host twin, so each op of
the op table the families use (copied splits of merged projections, Qwen2's matmul biases,
Gemma 3's embedding scale, head norms, GeGLU) goes through its GPU kernel and device memory.

What must hold: in ``auto`` and ``exact`` the logits equal the CPU generic backend's bitwise
(the twin is that backend's arithmetic: same 8 lanes, same integer sums, same float order),
and in ``exact`` they lie within two fp32 forward passes' rounding of the host's best
backend (``tolerances.forward_bound``: on a real GPU the reductions' order differs, which is
what that bound allows). The unfused graph (``silu`` and ``mul``, not ``swiglu``) runs too, and
a GPTQ act-order checkpoint (``gather_cols``) as well. ``benchmarks/gpu_check.py
--fidelity`` names a model the device cannot run instead of failing with a traceback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hf_quant import write_quantized
from safetensors.numpy import load_file, save_file
from test_cuda_device import cuda, forward
from tiny_models import MOE, SPECS, VOCAB, reference_model, write_gguf, write_hf_dir

from cuda_emulator import EmulatedLibcuda
from dynalm.core import cuda_driver
from dynalm.core.cpu_device import CpuDevice
from dynalm.core.devices import select_device
from dynalm.errors import DeviceUnavailable
from dynalm.ir.lower import unsupported
from dynalm.ir.lower.cuda import CudaBinder
from dynalm.ir.ops import OPS
from dynalm.models.loader import LoadedModel, load_model, model_graph
from tolerances import forward_bound, logit_scale

# the mixtures of experts' ops have no GPU kernels: `--backend auto` runs them on the CPU
FAMILIES = sorted(set(SPECS) - set(MOE))
# 20 tokens: the auto prefill's matmuls take the warps' mma tiles (16 rows and more), a
# whole tile of 16 and one of 4 rows past T
IDS: list[int] = np.random.default_rng(30).integers(0, VOCAB, 20).tolist()
Q8_0 = GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cuda")


def tiny(tiny_dir: Path, family: str) -> LoadedModel:
    """The family's tiny model with Q8_0 weights (``auto`` takes the int8 kernels for them),
    written once per module."""
    path = tiny_dir / f"{family}-q8_0.gguf"
    if not path.exists():
        write_gguf(reference_model(SPECS[family]), SPECS[family], path, Q8_0)
    return load_model(path)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[LoadedModel]:
    model = tiny(tiny_dir, request.param)
    yield model
    model.gguf.close()


# The encoder's ops (bert.lum) run per sequence over packed rows, which the GPU's row split
# of element-wise kernels does not cover yet: the device says so, and auto takes the CPU.
ENCODER_OPS = {"layer_norm", "gelu", "encoder_attention", "pool", "l2_norm"}
# A mixture of experts' routes pick each step's rows on the host: no GPU kernels yet either.
MOE_OPS = {"moe_route", "expert_matmul", "moe_combine"}


def test_every_op_of_the_table_has_a_gpu_kernel_but_the_encoders_and_experts():
    assert set(OPS) - set(CudaBinder.OP_TABLE) == ENCODER_OPS | MOE_OPS
    assert set(CudaBinder.OP_TABLE) <= set(OPS)


def test_an_encoder_on_the_gpu_names_the_op_and_auto_takes_the_cpu(tmp_path, monkeypatch):
    import tiny_bert

    path = tiny_bert.write_gguf(tiny_bert.reference_model(), tmp_path / "b.gguf", qtype=Q8_0)
    graph = load_model(path).graph
    gpu = EmulatedLibcuda()
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    why = unsupported(cuda(gpu), graph)
    assert why is not None and "no kernel for op 'layer_norm'" in why, why
    ask = lambda device: unsupported(device, graph)  # noqa: E731
    assert isinstance(select_device("auto", "auto", unsupported=ask), CpuDevice)
    with pytest.raises(DeviceUnavailable, match="cuda: .*no kernel for op 'layer_norm'"):
        select_device("gpu", "auto", unsupported=ask)


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_family_logits_equal_the_cpu(family_model, mode, monkeypatch):
    gpu = EmulatedLibcuda()
    device = cuda(gpu, mode)
    assert unsupported(device, family_model.graph) is None
    got = forward(family_model, device, IDS)
    assert gpu.launches > 0
    assert (gpu.warp_launches > 0) == (mode == "auto")  # the prefill's tensor-core tiles
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, forward(family_model, CpuDevice(mode), IDS))
    if mode == "exact":  # the host's best backend: its own summation order
        monkeypatch.delenv("DYNALM_ISA")
        best = forward(family_model, CpuDevice(mode), IDS)
        hp = family_model.hparams
        bound = forward_bound(hp.n_layers, max(hp.d_ff, hp.d_model), logit_scale(best))
        assert (np.abs(got - best) <= bound).all()


def test_unfused_activations_run_on_the_device(tiny_dir, monkeypatch):
    """``silu`` and ``mul`` apart (the graph before ``fuse-gated``): the GPU's kernels for
    them, and the CPU's, give the fused graph's logits (the same activation program)."""
    model = tiny(tiny_dir, "llama")
    unfused = dataclasses.replace(model, graph=model_graph(model.gguf, model.hparams))
    assert {"silu", "mul"} <= {n.op for n in unfused.graph.nodes}
    got = forward(unfused, cuda(EmulatedLibcuda()), IDS)
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, forward(unfused, CpuDevice("auto"), IDS))
    np.testing.assert_array_equal(got, forward(model, CpuDevice("auto"), IDS))


def test_permuted_inputs_gather_on_the_device(tmp_path, monkeypatch):
    """A GPTQ act-order checkpoint: its ``input_perm`` index (an argsort of ``g_idx``, so a
    permutation of the columns) puts a ``gather_cols`` before each permuted matmul; the
    GPU's gather gives the CPU's logits."""
    reference = reference_model(SPECS["llama"])
    path = write_hf_dir(reference, tmp_path / "llama-gptq")
    write_quantized(reference, path, "gptq", 32, act_order=True)
    # the unquantised tensors in F16 (the head: a JIT matmul; an F32 one has none on the GPU)
    f = path / "model.safetensors"
    tensors = {
        n: t.astype(np.float16) if t.dtype == np.float32 else t for n, t in load_file(f).items()
    }
    save_file(tensors, f, metadata={"format": "pt"})
    model = load_model(path)
    assert "gather_cols" in {n.op for n in model.graph.nodes}
    got = forward(model, cuda(EmulatedLibcuda()), IDS)
    monkeypatch.setenv("DYNALM_ISA", "generic")
    np.testing.assert_array_equal(got, forward(model, CpuDevice("auto"), IDS))


def test_attention_heads_the_gpu_has_no_kernel_for_choose_the_cpu(tiny_dir, monkeypatch):
    """Heads of 12 (not whole 8-lane vectors): the CPU has a numpy fallback, the GPU no
    kernel; ``--backend auto`` is told before any weight is read and ``--gpu`` refuses."""
    model = tiny(tiny_dir, "llama")
    graph = dataclasses.replace(
        model.graph,
        nodes=[
            dataclasses.replace(n, attrs={**n.attrs, "head_dim": 12}) if n.op == "attention" else n
            for n in model.graph.nodes
        ],
    )
    gpu = EmulatedLibcuda()
    monkeypatch.setattr(cuda_driver, "load", lambda library=None: cuda_driver.Driver(gpu))
    why = unsupported(cuda(gpu), graph)
    assert why is not None and why.startswith("no attention kernel for layer 0, n_heads 4, ")
    assert "head_dim 12" in why
    assert unsupported(CpuDevice("auto"), graph) is None
    ask = lambda device: unsupported(device, graph)  # noqa: E731
    assert isinstance(select_device("auto", "auto", unsupported=ask), CpuDevice)
    with pytest.raises(DeviceUnavailable, match="cuda: no attention kernel for .*head_dim 12"):
        select_device("gpu", "auto", unsupported=ask)


def test_gpu_check_fidelity_names_what_the_device_cannot_run(tiny_dir, monkeypatch, capsys):
    """The H200's case: a binder without ``split`` (the tiny llama's merged q/k/v need it).
    --fidelity prints the model, the op and why, goes on to the next model and exits 1;
    with every kernel present the same models pass (exit 0)."""
    import gpu_check

    paths = [str(tiny(tiny_dir, family).path) for family in ("llama", "qwen2")]
    assert gpu_check.fidelity(paths, emulate=True) == 0
    table = {op: bind for op, bind in CudaBinder.OP_TABLE.items() if op != "split"}
    monkeypatch.setattr(CudaBinder, "OP_TABLE", table)
    capsys.readouterr()
    assert gpu_check.fidelity(paths, emulate=True) == 1
    out = capsys.readouterr().out
    for path, arch in zip(paths, ("llama", "qwen2"), strict=True):
        line = f"{path}: not run on the GPU: {arch} graph, mode exact: no kernel for op 'split'"
        assert line in out.splitlines()
    assert "Traceback" not in out
