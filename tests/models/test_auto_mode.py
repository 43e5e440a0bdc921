"""`--mode auto` (int8 activations, integer dot products) stays close to `exact`.

On the SmolLM2 test prompts of the fidelity test: top-1 agreement with `exact` >= 98 % of
positions and mean KL(exact || auto) <= 0.005 (llama.cpp's own distance from the fp32
reference on this model is about 97.7 % and 0.004). `CpuDevice` lets `auto` use the int8
kernels only for formats validated this way.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from test_smollm2_fidelity import _dynalm_logits, _log_softmax, prompts  # noqa: F401

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel


def auto_vs_exact(loaded: LoadedModel, token_ids: list[list[int]]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(exact || auto)) over every position of ``token_ids``."""
    agree, kls = 0, []
    for ids in token_ids:
        exact = _log_softmax(_dynalm_logits(loaded, "exact", ids))
        auto = _log_softmax(_dynalm_logits(loaded, "auto", ids))
        agree += int((exact.argmax(-1) == auto.argmax(-1)).sum())
        kls.extend((np.exp(exact) * (exact - auto)).sum(-1))
    return agree / len(kls), float(np.mean(kls))


def test_auto_uses_int8_kernels_only_where_validated() -> None:
    device = CpuDevice("auto")
    assert device.matmul_kernel(GGMLQuantizationType.Q4_1, (576, 576)).kind == "jit-auto"
    assert device.matmul_kernel(GGMLQuantizationType.Q8_0, (576, 576)).kind == "jit-auto"
    # All-Q4_0 SmolLM2 in int8 agrees with exact on 96 % of top-1 positions: exact.
    assert device.matmul_kernel(GGMLQuantizationType.Q4_0, (576, 576)).kind == "jit-exact"


def test_auto_close_to_exact(model: LoadedModel, prompts: list[list[int]]) -> None:  # noqa: F811
    top1, kl = auto_vs_exact(model, prompts)
    assert top1 >= 0.98, f"top-1 agreement {top1:.4f}"
    assert kl <= 0.005, f"mean KL {kl:.5f}"
