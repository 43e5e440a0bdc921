"""`dynalm perplexity` against transformers' fp32-dequantised reference, by
llama-perplexity's method (windows of ctx tokens, the second half of each scored)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.perplexity import perplexity

CTX = 128
TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year the
only visitors were gulls and the men who brought oil and bread on the supply boat. The
keeper had lived there for eleven winters. He kept a logbook in which he wrote the
weather, the ships he saw, and the state of the lamp, and on quiet evenings he added a
few lines about the books he was reading. Over the years the logbook had become a kind
of diary, although he would never have called it that.

In the spring the fog came in from the sea almost every morning. It rolled over the
water in a grey wall, swallowed the rocks and the little jetty, and pressed against the
windows until the keeper could not see his own hand held out in front of him. On those
mornings he sounded the horn every two minutes, as the rules required, and listened for
the answering bells of the fishing boats feeling their way home. When the fog lifted, usually
before noon, the sea underneath was flat and bright, and the boats came in one by one.

The supply boat arrived on the first Monday of each month. Its skipper was a cheerful
woman who had grown up in the harbour town and knew every current along the coast. She
brought letters, newspapers a week old, tins of coffee, and once a small grey cat that
nobody in town had wanted. The cat took to the lighthouse at once. It slept on the warm
brass housing of the lamp and followed the keeper up and down the spiral stairs.
"""


@pytest.fixture(scope="module")
def ids(model: LoadedModel) -> list[int]:
    tokens = model.tokenizer.encode(TEXT, add_special=False)
    assert len(tokens) >= 2 * CTX, len(tokens)
    assert not model.tokenizer.add_bos  # SmolLM2: windows start with the text's own tokens
    return tokens


def reference_perplexity(reference: torch.nn.Module, ids: list[int]) -> tuple[float, int]:
    """llama-perplexity's method, written out on the reference: each window of CTX tokens
    scores tokens CTX/2 + 1 ... CTX - 1."""
    nll = []
    with torch.no_grad():
        for start in range(0, len(ids) - CTX + 1, CTX):
            window = ids[start : start + CTX]
            logits = reference(torch.tensor([window])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            nll += [-float(lp[j, window[j + 1]]) for j in range(CTX // 2, CTX - 1)]
    return math.exp(float(np.mean(nll))), len(nll)


def engine(model: LoadedModel, mode: str, **config: int) -> Engine:
    return Engine(
        model, CpuDevice(mode), EngineConfig(ctx=CTX + 1, enable_prefix_caching=False, **config)
    )


def test_exact_perplexity_equals_the_reference(model, ids, reference):
    expected, scored = reference_perplexity(reference, ids)
    ours = perplexity(engine(model, "exact"), ids, CTX)
    assert ours.scored_tokens == scored
    assert ours.windows == len(ids) // CTX
    assert abs(ours.ppl / expected - 1) <= 0.005, (ours.ppl, expected)
    assert 0 < ours.stderr < ours.ppl
    # windows in one step or chunked over many, batched or one at a time: the same figure
    one_by_one = engine(model, "exact", max_num_batched_tokens=40, max_num_seqs=1)
    chunked = perplexity(one_by_one, ids, CTX)
    assert chunked.ppl == pytest.approx(ours.ppl, rel=1e-9)


def test_cli_prints_ppl_error_and_speed(tmp_path: Path, smollm2_gguf: Path, model, ids):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    cmd = [sys.executable, "-m", "dynalm.cli", "perplexity", str(smollm2_gguf), str(text)]
    run = subprocess.run([*cmd, "--ctx", str(CTX)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    m = re.fullmatch(
        r"PPL = (\S+) \+/- (\S+) over (\d+) tokens \((\d+) windows of 128\), (\S+) tokens/s\n",
        run.stdout,
    )
    assert m, run.stdout
    in_process = perplexity(engine(model, "auto"), ids, CTX)
    assert float(m.group(1)) == pytest.approx(in_process.ppl, abs=1e-4)
    assert int(m.group(3)) == in_process.scored_tokens and float(m.group(5)) > 0

    short = subprocess.run([*cmd, "--ctx", "4096"], capture_output=True, text=True, timeout=300)
    assert short.returncode == 1 and "Traceback" not in short.stderr
    assert "fewer than one window of --ctx 4096" in short.stderr, short.stderr
