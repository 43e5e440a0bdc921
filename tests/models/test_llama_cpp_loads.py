"""Every tiny family's GGUF, as `tiny_models.write_gguf` writes it, is a file llama.cpp itself
loads and computes the same model from: llama-cpp-python (in a subprocess, see
`llama_cpp_check`) evaluates 20 tokens and its logits agree with transformers'. This is issue
28's check of key names, tensor names and shapes against llama.cpp's own loader; DynaLM's
logits on the same files are checked against transformers in `test_families`.

The families come from `tiny_models.SPECS`, so a family added there is checked here too.
Where llama-cpp-python is not installed (CI installs no ``bench`` extra) each case skips
and says so.

What each family's file needs (``write_gguf(..., for_llama_cpp=True, released_experts=False)``):

* phi3: llama.cpp's vocabulary loader gives a model whose ``general.name`` contains "phi3"
  Phi-3's SPM token rules, which look up ``</s>``; the tiny byte-level vocabulary has none
  and the lookup throws. ``for_llama_cpp`` names the model without "phi3" (the tensors and
  keys are the converter's either way).
* phi3 with LongRoPE: llama.cpp reads the long factors when its context exceeds the trained
  one (``n_ctx_orig_yarn``, 16 here), and it pads every context to a multiple of 256, so it
  never reads this tiny model's short factors; transformers picks by the input's length.
  The input is longer than 16 tokens, so both read the long factors: like with like
  (`test_families.test_phi3_longrope_reads_the_factors_of_its_context` shows the two
  factor sets give logits far apart, so the choice is not vacuous).
* gpt-oss: released files store the experts as MXFP4, and for an MXFP4 matmul llama.cpp
  rounds the activations to Q8_0 (MXFP4's ``vec_dot_type``): a relative error of ~2**-8 per
  activation, thousands of fp32 bounds off (measured: 2.5e3). So the experts here are
  written F32, as the converter writes a checkpoint whose experts are not MXFP4; their
  values are the MXFP4 numbers the reference's experts already hold (`reference_model`),
  so the file and transformers compute the same model in fp32. The MXFP4 file itself is
  DynaLM's to read (`test_families`, `test_moe_families`).

The bound: llama.cpp runs an F32 file on the CPU in fp32 (F32 weights, an F32 KV cache
asked for, no flash attention: KQ, softmax, rope, norms and SiLU all fp32), so it and
transformers are two fp32 forward passes, within `tolerances.forward_bound`. One step of
ggml's graph is not fp32: GELU (``GGML_GELU_FP16`` in ggml-cpu/vec.h) rounds its input to
fp16 and reads the result from a table of fp16 values. Each activation x so gets one
input rounding, carried through gelu' (|gelu'| <= 1.13), and one output rounding: an error
of at most 3 u16 |x| (u16 = 2**-11), independent per element. Unlike a sum's rounding
(sqrt(k) roundings per term), each term of the down projection carries this error once, so
a block adds ``LAMBDA * 3 * u16`` of the magnitudes it carries, and the blocks add up as a
random walk: ``LAMBDA * sqrt(n_layers) * 3 * u16 * scale`` on top of the fp32 bound
(gemma2 measured at 0.016 of it, gemma3 below that; the fp32 bound alone is 17x short for
gemma2).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_check import MIN_CTX, llama_cpp_logits, unavailable
from tiny_models import LONG_ROPE_ORIGINAL, SPECS, VOCAB, TinySpec, reference_model, write_gguf

from tolerances import LAMBDA, forward_bound, logit_scale

U_FP16 = 2.0**-11
GELU_ROUNDINGS = 3  # the input's rounding through |gelu'| <= 1.13, and the output's
N_TOKENS = 20
IDS: list[int] = np.random.default_rng(28).integers(0, VOCAB, N_TOKENS).tolist()


def _bound(spec: TinySpec, config: object, scale: np.ndarray) -> np.ndarray:
    """Per position, how far llama.cpp's logits may lie from transformers' (module docstring)."""
    inner = max(config.intermediate_size, config.hidden_size)
    bound = forward_bound(spec.n_layers, inner, scale)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "")
    if "gelu" in str(act):
        bound = bound + LAMBDA * math.sqrt(spec.n_layers) * GELU_ROUNDINGS * U_FP16 * scale
    return bound


@pytest.mark.parametrize("family", sorted(SPECS))
def test_llama_cpp_loads_and_agrees_with_transformers(family: str, tmp_path: Path) -> None:
    if reason := unavailable():
        pytest.skip(f"no llama.cpp check: {reason}")
    spec = SPECS[family]
    if spec.long_rope:  # both read the long factors (module docstring)
        assert N_TOKENS > LONG_ROPE_ORIGINAL, "transformers would read the short factors"
        assert MIN_CTX > LONG_ROPE_ORIGINAL, "llama.cpp reads the long factors"
    reference = reference_model(spec)
    path = write_gguf(
        reference, spec, tmp_path / f"{family}.gguf", for_llama_cpp=True, released_experts=False
    )
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0].to(torch.float32).numpy()
    got = llama_cpp_logits(path, IDS)
    assert got.shape == want.shape, f"llama.cpp gave logits {got.shape}, want {want.shape}"
    assert np.isfinite(got).all()
    bound = _bound(spec, reference.config, logit_scale(want))
    worst = float((np.abs(got - want) / bound).max())
    assert worst <= 1.0, f"{family}: llama.cpp's logits differ by {worst:.3g} of the bound"
    # top-1: identical wherever the reference's top-2 margin exceeds twice the bound
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * bound[:, 0]
    assert decided.sum() >= N_TOKENS // 2, f"{family}: few top-1 margins above the bound"
    same = got.argmax(axis=1) == want.argmax(axis=1)
    assert same[decided].all(), f"{family}: top-1 differs at {np.flatnonzero(~same & decided)}"
