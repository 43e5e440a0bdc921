"""Aggregate decode speed with several sequences decoding in one batch.

For each batch size B, B requests of random prompts start together in one engine (at most B
sequences a step) and sample their answers (temperature 0.8, top-p 0.95, f16 KV); the
tokens decoded after every sequence has its first token, over the time that took, is the
aggregate rate (what a server's concurrent users get together). Each size runs twice, the
second timed (the first compiles and prepares).

    python benchmarks/batched_decode.py MODEL [--batches 1,2,4] [--tokens 40] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dynalm.core.cpu_device import CpuDevice
from dynalm.models.loader import load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams

PROMPT_TOKENS = 16


def aggregate_rate(engine: Engine, batch: int, tokens: int, seed: int) -> tuple[int, float]:
    """(tokens decoded, seconds) once all ``batch`` sequences have their first token."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, seed=seed)
    vocab = engine.model.hparams.n_vocab
    for i in range(batch):
        prompt = rng.integers(0, vocab, PROMPT_TOKENS).tolist()
        engine.add_request(f"{seed}-{i}", prompt, params, stop_ids=frozenset())
    started: set[str] = set()
    decoded, t0 = 0, 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in started:
                started.add(out.request_id)
                if len(started) == batch:
                    t0, decoded = time.perf_counter(), 0
                continue
            decoded += len(out.token_ids)
    return decoded, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--batches", default="1,2,4", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=40, help="tokens each request decodes")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    args = parser.parse_args()
    model = load_model(args.model)
    for batch in (int(b) for b in args.batches.split(",")):
        config = EngineConfig(
            ctx=PROMPT_TOKENS + args.tokens + 16, max_num_seqs=batch, kv_cache_dtype="f16"
        )
        engine = Engine(model, CpuDevice("auto", threads=args.threads), config)
        aggregate_rate(engine, batch, args.tokens, seed=0)  # compiles, prepares experts
        decoded, seconds = aggregate_rate(engine, batch, args.tokens, seed=1)
        print(f"B={batch}: {decoded / seconds:.1f} tokens/s ({decoded} tokens, {seconds:.2f} s)")


if __name__ == "__main__":
    main()
