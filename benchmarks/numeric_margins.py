"""How much of its derived budget (tests/tolerances.py) the safe-vs-exact gap uses, per
OpenBLAS kernel family: numpy's matmuls sum in the order of the kernels OpenBLAS picks for
the CPU, so forcing ``OPENBLAS_CORETYPE`` replays an AVX2 (Haswell, Zen), AVX-512
(SkylakeX, Cooperlake) or AMX host's (SapphireRapids: AMX for bf16 only, AVX-512 sgemm)
safe mode on this machine. The JIT kernels' order does not depend on the host.

    python benchmarks/numeric_margins.py --model SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CORETYPES = ("Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids")
PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is 12 times 7?"]


def measure(model_path: str) -> dict[str, float]:
    """In this process: the worst |safe - exact| / bound and the worst |safe - exact|."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import numpy as np

    from dynalm.core.cpu_device import CpuDevice
    from dynalm.models.loader import load_model
    from dynalm.runtime.engine.engine import Engine
    from dynalm.runtime.generator import Generator, generator_config
    from tolerances import forward_bound, logit_scale

    model = load_model(model_path)
    hp = model.hparams
    worst, ratio = 0.0, 0.0
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = model.tokenizer.encode(model.chat_template.render(messages), add_special=False)
        safe, exact = (
            Generator(Engine(model, CpuDevice(mode), generator_config(512))).forward(
                ids, all_logits=True
            )
            for mode in ("safe", "exact")
        )
        gap = np.abs(safe - exact)
        bound = forward_bound(hp.n_layers, max(hp.d_ff, hp.d_model), logit_scale(safe))
        worst, ratio = max(worst, float(gap.max())), max(ratio, float((gap / bound).max()))
    return {"max_gap": worst, "of_bound": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model)))
        return
    print(f"{'OPENBLAS_CORETYPE':<18} {'max |safe - exact|':>19} {'of the bound':>13}")
    for core in CORETYPES:
        env = {**os.environ, "OPENBLAS_CORETYPE": core}
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--child"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{core:<18} {r['max_gap']:>19.3g} {r['of_bound']:>13.3f}")


if __name__ == "__main__":
    main()
