"""Every tiny family's GGUF, as `tiny_models.write_gguf` writes it, is a file llama.cpp itself
loads and computes the same model from: llama-cpp-python (in a subprocess, see
`llama_cpp_check`) evaluates 20 tokens and its logits agree with transformers'.

The families come from `tiny_models.SPECS`, so a family added there is checked here too.
Where llama-cpp-python is not installed (CI installs no ``bench`` extra) each case skips
and says so.

The bound: llama.cpp runs an F32 file on the CPU in fp32 (F32 weights, an F32 KV cache
asked for, no flash attention: KQ, softmax, rope, norms and SiLU all fp32), so it and
transformers are two fp32 forward passes, within `tolerances.forward_bound`. One step of
ggml's graph is not fp32: GELU (``GGML_GELU_FP16`` in ggml-cpu/vec.h) rounds its input to
fp16 and reads the result from an fp16 table. For a family whose activation is a GELU the
bound is the same expression at fp16's unit roundoff (2**-11): loose (gemma3 lands at ~5e-4
of it) but still a fraction of a logit's scale, which a wrong tensor layout, norm
convention or rope misses by far.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_check import llama_cpp_logits, unavailable
from tiny_models import SPECS, VOCAB, reference_model, write_gguf

from tolerances import U, forward_bound, logit_scale

U_FP16 = 2.0**-11
N_TOKENS = 20
IDS: list[int] = np.random.default_rng(28).integers(0, VOCAB, N_TOKENS).tolist()


def _unit_roundoff(config: object) -> float:
    """The unit roundoff of llama.cpp's least precise step for this model (see the module
    docstring): fp16 where the activation is a GELU, fp32 otherwise."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "")
    return U_FP16 if "gelu" in str(act) else U


@pytest.mark.parametrize("family", sorted(SPECS))
def test_llama_cpp_loads_and_agrees_with_transformers(family: str, tmp_path: Path) -> None:
    if reason := unavailable():
        pytest.skip(f"no llama.cpp check: {reason}")
    spec = SPECS[family]
    reference = reference_model(spec)
    path = write_gguf(reference, spec, tmp_path / f"{family}.gguf")
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0].to(torch.float32).numpy()
    got = llama_cpp_logits(path, IDS)
    assert got.shape == want.shape, f"llama.cpp gave logits {got.shape}, want {want.shape}"
    assert np.isfinite(got).all()
    inner = max(reference.config.intermediate_size, reference.config.hidden_size)
    scale = logit_scale(want)
    bound = forward_bound(spec.n_layers, inner, scale) * (_unit_roundoff(reference.config) / U)
    worst = float((np.abs(got - want) / bound).max())
    assert worst <= 1.0, f"{family}: llama.cpp's logits differ by {worst:.3g} of the bound"
    # top-1: identical wherever the reference's top-2 margin exceeds twice the bound
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * bound[:, 0]
    assert decided.any(), f"{family}: no position has a top-1 margin above the bound"
    same = got.argmax(axis=1) == want.argmax(axis=1)
    assert same[decided].all(), f"{family}: top-1 differs at {np.flatnonzero(~same & decided)}"
