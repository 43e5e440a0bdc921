"""SmolLM2-135M Q4_1 against transformers' fp32-dequantised reference (the accuracy contract).

`exact` must match the reference: top-1 agreement >= 99 % of positions, max |Δ log-prob|
over the reference's top-5 <= 0.01, identical 32-token greedy continuations; `safe`
must equal `exact` within the rounding of two fp32 passes (`tolerances.forward_bound`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.generator import Generator, generator_config
from tolerances import forward_bound, logit_scale

CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "84."},
        {"role": "user", "content": "And divided by 4?"},
    ],
]
TEXTS = [
    "The history of the Roman Empire begins with",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which plants",
]
CONTINUATION = 32


@pytest.fixture(scope="module")
def prompts(model: LoadedModel) -> list[list[int]]:
    tok, template = model.tokenizer, model.chat_template
    chats = [tok.encode(template.render(m), add_special=False) for m in CHATS]
    return chats + [tok.encode(t, add_special=True) for t in TEXTS]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _dynalm_logits(model: LoadedModel, mode: str, ids: list[int]) -> np.ndarray:
    generator = Generator(Engine(model, CpuDevice(mode), generator_config(512)))
    return generator.forward(ids, all_logits=True)


@pytest.fixture(scope="module")
def reference_runs(
    reference: torch.nn.Module, prompts: list[list[int]]
) -> list[tuple[np.ndarray, list[int]]]:
    """Per prompt: reference logits at every prompt position, and its greedy continuation."""
    runs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            logits = reference(x).logits[0].numpy()
            out = reference.generate(
                x,
                max_new_tokens=CONTINUATION,
                do_sample=False,
                attention_mask=torch.ones_like(x),
                pad_token_id=2,
                eos_token_id=None,
            )
            runs.append((logits, out[0, len(ids) :].tolist()))
    return runs


def test_exact_matches_reference_logits(model, prompts, reference_runs):
    agree = total = 0
    worst = 0.0
    for ids, (ref_logits, _) in zip(prompts, reference_runs, strict=True):
        ours = _dynalm_logits(model, "exact", ids)
        agree += int((ours.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += len(ids)
        ref_lp, our_lp = _log_softmax(ref_logits), _log_softmax(ours)
        top5 = np.argsort(-ref_lp, axis=-1)[:, :5]
        diff = np.abs(np.take_along_axis(ref_lp, top5, -1) - np.take_along_axis(our_lp, top5, -1))
        worst = max(worst, float(diff.max()))
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"
    assert worst <= 0.01, f"max |Δ log-prob| over the reference top-5 = {worst:.4g}"


def test_exact_greedy_continuations_identical(model, prompts, reference_runs):
    greedy = SamplingParams(max_tokens=CONTINUATION, temperature=0, repeat_penalty=1.0)
    for ids, (_, ref_tokens) in zip(prompts, reference_runs, strict=True):
        gen = Generator(Engine(model, CpuDevice("exact"), generator_config(512)))
        ours = [
            e.token for e in gen.generate(ids, greedy, stop_ids=frozenset()) if e.token is not None
        ]
        assert ours == ref_tokens, (
            model.tokenizer.decode(ours) + " != " + model.tokenizer.decode(ref_tokens)
        )


def test_safe_equals_exact(model, prompts):
    """Two fp32 forward passes (numpy + OpenBLAS, whose summation order depends on the CPU,
    vs the JIT kernels) agree within `tolerances.forward_bound`: 30 layers, summations up to
    the FFN's 1536, relative to each position's largest |logit| (~40 here: a bound of ~8e-3).
    Measured max |safe - exact|: 7.3e-5 with OpenBLAS's AVX2 kernels, 1.45e-4 with its
    AVX-512 ones (OPENBLAS_CORETYPE=Haswell / SkylakeX on one Zen 5)."""
    hp = model.hparams
    for ids in prompts[:3]:
        safe = _dynalm_logits(model, "safe", ids)
        exact = _dynalm_logits(model, "exact", ids)
        bound = forward_bound(hp.n_layers, max(hp.d_ff, hp.d_model), logit_scale(safe))
        worst = np.abs(safe - exact) / bound
        assert worst.max() <= 1, f"|safe - exact| reaches {worst.max():.2f} of the bound"
