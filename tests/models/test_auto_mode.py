"""`--mode auto` (int8 activations, integer dot products) stays close to `exact`.

Two measures of the same contract:

* the SmolLM2 test prompts of the fidelity test (158 positions): top-1 agreement with
  `exact` >= 98 % and mean KL(exact || auto) <= 0.005 (llama.cpp's own distance from the
  fp32 reference on this model is about 97.7 % and 0.004);
* a fixed 2,048-token corpus (`data/auto_corpus.txt`, prose, lists and code): KL <= 0.005
  and top-1 >= 96 %. On 158 positions the 98 % bar allows three flips, so one format can
  miss it by two tokens of noise; over 2,048 positions the formats admitted first agree
  96.9 % (Q4_1 layers) and 97.1 % (all Q8_0), so a format that hurts `auto` more than those
  falls below 96 %.

`CpuDevice` lets `auto` use the int8 kernels only for formats validated this way; the
requantised files here are written with gguf-py's reference quantiser (the same blocks as
llama.cpp's `llama-quantize` without an importance matrix).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_smollm2_fidelity import _dynalm_logits, _log_softmax, prompts  # noqa: F401

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import LoadedModel, load_model

CORPUS = Path(__file__).parent / "data" / "auto_corpus.txt"
WINDOW = 256  # tokens per forward pass over the corpus


def auto_vs_exact(loaded: LoadedModel, token_ids: list[list[int]]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(exact || auto)) over every position of ``token_ids``."""
    agree, kls = 0, []
    for ids in token_ids:
        exact = _log_softmax(_dynalm_logits(loaded, "exact", ids))
        auto = _log_softmax(_dynalm_logits(loaded, "auto", ids))
        agree += int((exact.argmax(-1) == auto.argmax(-1)).sum())
        kls.extend((np.exp(exact) * (exact - auto)).sum(-1))
    return agree / len(kls), float(np.mean(kls))


def corpus_windows(loaded: LoadedModel) -> list[list[int]]:
    ids = loaded.tokenizer.encode(CORPUS.read_text(), add_special=False)[: 8 * WINDOW]
    return [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]


def requantize(source: Path, out: Path, old: Q, new: Q) -> Path:
    """``source`` with every tensor of type ``old`` requantised to ``new`` (the others
    and the metadata copied)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch=None)  # the architecture key is copied below
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype == old:
            data, qtype = gguf.quants.quantize(gguf.quants.dequantize(data, old), new), new
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def q4_0_model(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The test model with its Q4_1 layers requantised to Q4_0 (the Q8_0 head kept)."""
    out = tmp_path_factory.mktemp("q4_0") / "smollm2-q4_0.gguf"
    return load_model(requantize(smollm2_gguf, out, Q.Q4_1, Q.Q4_0))


def test_auto_uses_int8_kernels_only_where_validated() -> None:
    device = CpuDevice("auto")
    for validated in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_NL):
        assert device.matmul_kernel(validated, (576, 576)).kind == "jit-auto"
    assert device.matmul_kernel(Q.IQ4_XS, (576, 1536)).kind == "jit-auto"
    # All-Q5_1 SmolLM2: 97.5 % / KL 0.0040 on the prompts, 96.2 % on the corpus: too near.
    # MXFP4 layers: KL 0.0051 on the prompts, over the budget (core/matmul.py's figures).
    for refused in (Q.Q5_1, Q.MXFP4):
        assert device.matmul_kernel(refused, (576, 576)).kind == "jit-exact"


def test_auto_close_to_exact(model: LoadedModel, prompts: list[list[int]]) -> None:  # noqa: F811
    top1, kl = auto_vs_exact(model, prompts)
    assert top1 >= 0.98, f"top-1 agreement {top1:.4f}"
    assert kl <= 0.005, f"mean KL {kl:.5f}"


@pytest.mark.parametrize("which", ["test model (Q4_1 layers)", "Q4_0 layers"])
def test_auto_close_to_exact_on_the_corpus(
    which: str, model: LoadedModel, q4_0_model: LoadedModel
) -> None:
    # Measured: Q4_1 layers 96.9 % / 0.0021; Q4_0 layers 96.5 % / 0.0025.
    loaded = q4_0_model if which.startswith("Q4_0") else model
    windows = corpus_windows(loaded)
    assert sum(map(len, windows)) == 8 * WINDOW
    top1, kl = auto_vs_exact(loaded, windows)
    assert top1 >= 0.96, f"top-1 agreement {top1:.4f}"
    assert kl <= 0.005, f"mean KL {kl:.5f}"
