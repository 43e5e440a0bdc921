"""What a grammar costs per generated token: decode steps with every sequence under a JSON
schema (llguidance's mask, computed on its own thread while the model runs, then applied
to the logits) against the same steps unconstrained.

Each setting runs ``--batch`` greedy sequences for ``--tokens`` decode steps; the two
settings alternate ``--repeats`` times (a shared machine loads both alike) and the median
step time of each is compared, counting only steps where the whole batch decodes. Also
shown: the mask's own time per sequence (computed alone, not overlapped) and the time to
apply it. ``--big-vocab`` runs a gemma-3-shaped file with a 262,144-token vocabulary
(random weights, written by tests/models/big_vocab.py into a temporary folder).

    python benchmarks/guided_overhead.py [--model GGUF | --big-vocab] [--batch 1,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dynalm.core.device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine import Engine, EngineConfig
from dynalm.runtime.guided import MaskWorker, apply_masks
from dynalm.runtime.sampling import SamplingParams
from dynalm.runtime.structured import json_grammar

# A schema whose answer is long: free text in a string of 1,000 characters at least, so the
# grammar stays open for every step measured.
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "body": {"type": "string", "minLength": 1000}},
    "required": ["title", "body"],
    "additionalProperties": False,
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with a title and a body."


def decode_steps(engine: Engine, prompt: list[int], batch: int, tokens: int, guided: bool):
    """Step times (s) of the decode steps in which all ``batch`` sequences ran."""
    grammar = engine.grammars.compile(json_grammar(SCHEMA)) if guided else None
    params = SamplingParams(max_tokens=tokens, temperature=0, repeat_penalty=1.0)
    for i in range(batch):
        guide = None if grammar is None else grammar.copy()
        engine.add_request(f"{guided}-{i}", prompt, params, stop_ids=frozenset(), guide=guide)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        decoding = [o for o in outputs if o.completion_tokens > 1]
        if len(decoding) == batch and not any(o.finished for o in outputs):
            times.append(elapsed)
    return times


def mask_costs(engine: Engine, prompt: list[int], repeats: int = 200) -> tuple[float, float]:
    """Seconds per sequence-token: a mask computed alone; a mask applied to one row."""
    guide = engine.grammars.compile(json_grammar(SCHEMA))
    for token in engine.grammars.tokenizer.greedy_tokenize('{"title": "The keeper'):
        guide.consume(token)

    worker = MaskWorker(engine.model.hparams.n_vocab)
    masks = worker.start([guide]).result()
    t0 = time.perf_counter()
    for _ in range(repeats):
        masks = worker.start([guide]).result()
    compute = (time.perf_counter() - t0) / repeats
    logits = np.random.default_rng(0).normal(size=(1, engine.model.hparams.n_vocab))
    logits = logits.astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_masks(logits, [0], masks)
    return compute, (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("DYNALM_TEST_MODEL"))
    ap.add_argument("--big-vocab", action="store_true", help="the 262k-vocabulary file")
    ap.add_argument("--batch", default="1,4", help="sequences per step, comma-separated")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two settings")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.big_vocab:
            sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "models"))
            from big_vocab import write_big_vocab_gguf

            path = write_big_vocab_gguf(Path(tmp) / "big-vocab.gguf")
        elif args.model:
            path = Path(args.model)
        else:
            ap.error("give --model (or set DYNALM_TEST_MODEL) or --big-vocab")
        model = load_model(path)
        engine = Engine(model, CpuDevice(), EngineConfig(ctx=1024))
    chat = [{"role": "user", "content": PROMPT}]
    prompt = model.tokenizer.encode(model.chat_template.render(chat), add_special=False)
    compute, apply = mask_costs(engine, prompt)
    vocab = model.hparams.n_vocab
    print(f"{model.name}: vocabulary {vocab:,}; decode steps of {args.tokens} tokens")
    print(
        f"mask alone, per sequence-token: compute {compute * 1e3:.3f} ms, "
        f"apply {apply * 1e3:.3f} ms"
    )
    for batch in map(int, args.batch.split(",")):
        plain: list[float] = []
        guided: list[float] = []
        for _ in range(args.repeats):
            plain += decode_steps(engine, prompt, batch, args.tokens, guided=False)
            guided += decode_steps(engine, prompt, batch, args.tokens, guided=True)
        p, g = statistics.median(plain), statistics.median(guided)
        serial = batch * (compute + apply)  # were the masks neither overlapped nor parallel
        print(
            f"batch {batch}: decode step {p * 1e3:.2f} ms plain, {g * 1e3:.2f} ms under the "
            f"schema: measured overhead {100 * (g - p) / p:+.1f} % per token "
            f"({len(plain)} / {len(guided)} steps); masks computed and applied serially: "
            f"{100 * serial / p:.1f} % of a plain step"
        )


if __name__ == "__main__":
    main()
