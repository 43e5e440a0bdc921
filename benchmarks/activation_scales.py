"""What `auto`'s int8 activations cost at each scale granularity, on the test model: safe
mode's fp32 matmuls with their inputs rounded to int8 (symmetric, round to nearest) per
block of B values, each block one scale (or, "32/2", two: auto's ``X_GROUPS``, the values
of the even and of the odd 4-value chunks of 32), measured as tests/models/test_auto_mode.py
measures auto against exact: top-1 agreement and mean KL(exact || rounded) on the fidelity
prompts (158 positions) and the 2,048-token corpus. Its budget: KL <= 0.005, top-1 >= 98 %
(prompts) and >= 96 % (corpus).

Why it matters: a matmul's float work per block (converting and scaling each scale's
integer sums) shares the vector pipes with the integer dot products, so coarser scales
(llama.cpp's one per 32 for Q4_0 and Q8_0 weights, one per 256 -- q8_K -- for the
K-quants) would make the int8 tiles faster; this says what they would cost. A block size
that does not divide a row (SmolLM2's 576 columns against 256) takes 192 there.

    python benchmarks/activation_scales.py [--model PATH] [--blocks 32/2,32,64,256]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

from dynalm.core.cpu_device import CpuDevice  # noqa: E402
from dynalm.kernel.matmul_programs import X_GROUPS  # noqa: E402
from dynalm.models.loader import LoadedModel, load_model  # noqa: E402
from dynalm.runtime.engine.engine import Engine  # noqa: E402
from dynalm.runtime.generator import Generator, generator_config  # noqa: E402


def rounded(x: np.ndarray, block: int, groups: bool) -> np.ndarray:
    """``x`` [T, K] rounded to int8 per ``block`` values (``groups``: per X_GROUPS group
    of each 32) and back to float."""
    blocks = x.reshape(len(x), -1, block)
    parts = [np.asarray(g) for g in X_GROUPS] if groups else [np.arange(block)]
    out = np.empty_like(blocks)
    for lanes in parts:
        part = blocks[:, :, lanes]
        d = np.abs(part).max(-1, keepdims=True) / 127
        safe_d = np.where(d > 0, d, 1)
        out[:, :, lanes] = np.round(part / safe_d) * d
    return out.reshape(x.shape)


class RoundedInputs(CpuDevice):
    """Safe mode whose matmuls see their inputs rounded (``rounded``) per ``block``
    ("32/2": auto's two groups per 32)."""

    def __init__(self, block: str) -> None:
        super().__init__("safe")
        self.groups = block == "32/2"
        self.block = 32 if self.groups else int(block)

    def matmul(self, raw, ggml_type, shape, **how):  # type: ignore[no-untyped-def]
        fp32 = super().matmul(raw, ggml_type, shape, **how)
        k = shape[1]
        block = self.block if k % self.block == 0 else 192 if k % 192 == 0 else 32

        def run(x: np.ndarray, out: np.ndarray) -> None:
            fp32(rounded(np.asarray(x, np.float32), block, self.groups), out)

        return run


def log_probs(model: LoadedModel, device: CpuDevice, ids: list[int]) -> np.ndarray:
    from test_smollm2_fidelity import _log_softmax

    generator = Generator(Engine(model, device, generator_config(512)))
    return _log_softmax(generator.forward(ids, all_logits=True))


def measures(exact: list[np.ndarray], other: list[np.ndarray]) -> tuple[float, float]:
    pairs = list(zip(exact, other, strict=True))
    agree = sum(int((e.argmax(-1) == o.argmax(-1)).sum()) for e, o in pairs)
    kl = np.concatenate([(np.exp(e) * (e - o)).sum(-1) for e, o in pairs])
    return agree / len(kl), float(kl.mean())


def main() -> None:
    from test_auto_mode import corpus_windows
    from test_smollm2_fidelity import CHATS, TEXTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("DYNALM_TEST_MODEL"))
    parser.add_argument("--blocks", default="32/2,32,64,256")
    args = parser.parse_args()
    if not args.model:
        parser.error("--model PATH (or $DYNALM_TEST_MODEL)")
    model = load_model(Path(args.model))
    tok, template = model.tokenizer, model.chat_template
    prompts = [tok.encode(template.render(m), add_special=False) for m in CHATS]
    prompts += [tok.encode(t, add_special=True) for t in TEXTS]
    sets = {"prompts": prompts, "corpus": corpus_windows(model)}
    print("| set | activations | top-1 | mean KL |\n|---|---|---|---|")
    for name, windows in sets.items():
        exact = [log_probs(model, CpuDevice("exact"), ids) for ids in windows]
        runs = {"auto (the int8 kernels)": CpuDevice("auto")}
        runs |= {f"rounded per {b}": RoundedInputs(b) for b in args.blocks.split(",")}
        for label, device in runs.items():
            top1, kl = measures(exact, [log_probs(model, device, ids) for ids in windows])
            print(f"| {name} | {label} | {100 * top1:.2f} % | {kl:.5f} |", flush=True)


if __name__ == "__main__":
    main()
