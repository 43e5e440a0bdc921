"""Memory: a model costs about its file once, not twice, plus a bounded overhead.

The budget `dynalm bench` checks is peak RSS <= the memory plan + 10 % (it was file + KV
pool + 300 MB, when the figures below were measured). What used to break
it: the embedding's mapped rows beside the repacked head (tied weights), a repacked weight
beside its whole mapped source while repacking, int8 activation buffers per matmul, and a
262k-vocabulary tokenizer's build temporaries. Measured on a 2-core Zen 5 (AVX-512): SmolLM2
272 MB (306 MB when the JIT compiles in the same process) of 411 MB; the 262k-vocabulary file
438 / 457 MB of 508 MB.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from big_vocab import write_big_vocab_gguf
from test_cli import dynalm

from dynalm.core import memory as weight_memory
from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams


def resident_bytes_of(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (Linux /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                inside = len(fields) > 5 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.fixture(scope="module")
def big_vocab_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_big_vocab_gguf(tmp_path_factory.mktemp("big") / "big-vocab.gguf")


def test_repacked_weights_leave_their_mapped_source(smollm2_gguf: Path):
    """Once bound, the weights live in the executor's repacked copy: a prefill over random
    tokens (every embedding lookup of it) leaves almost none of the file resident. The head
    is tied to the embedding, so the table the lookups read is the repacked head's source."""
    model = load_model(smollm2_gguf.resolve())
    engine = Engine(model, CpuDevice("auto"), EngineConfig(ctx=600, max_num_seqs=1))
    ids = np.random.default_rng(0).integers(0, model.hparams.n_vocab, 512).tolist()
    engine.add_request("r", ids, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    resident = resident_bytes_of(smollm2_gguf.resolve())
    # before: the 512 looked-up rows faulted in whole folios of the mapping, 25 MB of 98
    # (the metadata's pages, up to 2 MiB at a time where the file sits in large folios)
    assert resident <= 0.02 * smollm2_gguf.stat().st_size + 2**21, resident


@pytest.mark.parametrize("which", ["smollm2", "big_vocab"])
def test_bench_peak_rss_within_budget(which: str, smollm2_gguf: Path, request):
    """Peak RSS of `dynalm bench` (prefill and decode) <= the memory plan + 10 %, for the test
    model and for a 262,144-token vocabulary (gemma-3-shaped, tied head, Q4_K_M-like)."""
    path = smollm2_gguf if which == "smollm2" else request.getfixturevalue("big_vocab_gguf")
    result = dynalm("bench", str(path), "-p", "128", "-n", "32", "-r", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    memory = report["memory"]
    # the weights as they lie: read into huge pages where the kernel has them (the RSS
    # counts them either way)
    assert report["load"]["weight_pages"] == ("huge" if weight_memory.huge_pages() else "mapped")
    # more than the mapped file alone: the measurement really covers the weights
    assert memory["file_bytes"] < memory["peak_rss_bytes"] <= memory["budget_bytes"], memory
    assert memory["within_budget"]
