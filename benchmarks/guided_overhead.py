"""What a grammar costs per generated token: decode steps with every sequence under a JSON
schema (llguidance's mask, computed on its own thread while the model runs, then applied
to the logits) against the same steps unconstrained.

Each setting runs ``--batch`` greedy sequences for ``--tokens`` decode steps; the two
settings alternate ``--repeats`` times (a shared machine loads both alike) and the median
step time of each is compared, counting only steps where the whole batch decodes. On a
loaded machine that difference is noise of +-15 %, so the engine thread's own time on masks
is also timed inside the steps: waiting for them, applying them and advancing the matchers
(the critical path a grammar adds). Also shown: a mask's time computed alone (not
overlapped) and applied. ``--big-vocab`` runs a gemma-3-shaped file with a 262,144-token vocabulary
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
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine import engine as engine_module
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.guided import Guide, MaskWorker, apply_masks
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.serve.structured import json_grammar

# A schema whose answer is long: free text in a string of 1,000 characters at least, so the
# grammar stays open for every step measured.
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "body": {"type": "string", "minLength": 1000}},
    "required": ["title", "body"],
    "additionalProperties": False,
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with a title and a body."


class MaskTime:
    """Seconds the engine thread spends on masks (patched into the engine's module)."""

    seconds = 0.0

    @classmethod
    def timed(cls, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - t0

        return run

    @classmethod
    def install(cls) -> None:
        class TimedWorker(MaskWorker):
            def start(self, guides) -> Future:
                future = super().start(guides)
                future.result = cls.timed(future.result)  # the wait for the masks
                return future

        engine_module.MaskWorker = TimedWorker
        engine_module.apply_masks = cls.timed(apply_masks)
        Guide.consume = cls.timed(Guide.consume)


def decode_steps(engine: Engine, prompt: list[int], batch: int, tokens: int, guided: bool):
    """Step times (s) of the decode steps in which all ``batch`` sequences ran."""
    grammar = engine.grammars.compile(json_grammar(SCHEMA)) if guided else None
    params = SamplingParams(max_tokens=tokens, temperature=0, repeat_penalty=1.0)
    for i in range(batch):
        guide = None if grammar is None else grammar.copy()
        engine.add_request(f"{guided}-{i}", prompt, params, stop_ids=frozenset(), guide=guide)
    times, on_masks = [], []
    while engine.has_unfinished():
        MaskTime.seconds = 0.0
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        decoding = [o for o in outputs if o.completion_tokens > 1]
        if len(decoding) == batch and not any(o.finished for o in outputs):
            times.append(elapsed)
            on_masks.append(MaskTime.seconds)
    return times, on_masks


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
    MaskTime.install()
    vocab = model.hparams.n_vocab
    print(f"{model.name}: vocabulary {vocab:,}; decode steps of {args.tokens} tokens")
    print(
        f"mask alone, per sequence-token: compute {compute * 1e3:.3f} ms, "
        f"apply {apply * 1e3:.3f} ms"
    )
    for batch in map(int, args.batch.split(",")):
        plain: list[float] = []
        guided: list[float] = []
        on_masks: list[float] = []
        for _ in range(args.repeats):
            plain += decode_steps(engine, prompt, batch, args.tokens, guided=False)[0]
            times, waits = decode_steps(engine, prompt, batch, args.tokens, guided=True)
            guided += times
            on_masks += waits
        p, g, m = (statistics.median(x) for x in (plain, guided, on_masks))
        print(
            f"batch {batch}: decode step {p * 1e3:.2f} ms plain, {g * 1e3:.2f} ms under the "
            f"schema ({100 * (g - p) / p:+.1f} %, {len(plain)} / {len(guided)} steps); "
            f"engine thread on masks {m * 1e3:.3f} ms a step = {100 * m / p:.1f} % of a "
            f"plain step"
        )


if __name__ == "__main__":
    main()
