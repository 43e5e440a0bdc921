"""Embedding throughput under concurrency: ``--requests`` single-input ``/v1/embeddings``
requests sent at once (distinct texts of about 8-16 words), inputs/s over the wall time of
each round; and, for comparison, the same inputs as one request. Starts `dynalm serve` on a
loopback port (``--pooling`` passed on: a generation model embeds with it).

``--beside-generation``: what embedding requests do to a generation stream on the same
server. The generation model is served with a copy of itself whose metadata says
``{arch}.pooling_type`` last (the same weights embed: a Qwen3-Embedding of its size); a
streamed greedy chat of ``--gen-tokens`` tokens is timed alone, then while requests of
``--requests`` inputs are sent back to back: inter-token gaps (p50, p95, max) and the
embedding inputs/s meanwhile, and alone (``--rounds`` requests with the generation model
loaded and idle). ``--max-num-batched-tokens`` is both models' step budget.

``--ttft N`` (with the same two models): the time to the first token of N new chat requests,
each sent after a pause of 0.1-0.6 s (seeded) so that they arrive at every point of an
embedding step, alone and then while embedding requests run back to back: p50, p95, max.

    python benchmarks/embed_concurrency.py --model tiny-bert.gguf
    python benchmarks/embed_concurrency.py --model SmolLM2-135M-Instruct.Q4_1.gguf --pooling last
    python benchmarks/embed_concurrency.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --beside-generation --requests 32 --rounds 2
    python benchmarks/embed_concurrency.py --model SmolLM2-135M-Instruct.Q4_1.gguf --ttft 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from serve_load import TOPICS, Client, Sample, question, started_server

URL = "/v1/embeddings"


def text(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"a few words about {topic}, number {i}, " + "and some more " * (i % 4)


async def one_round(http: httpx.AsyncClient, n: int, together: bool) -> float:
    """Seconds to embed ``n`` texts: ``n`` requests at once, or one request of ``n``."""
    texts = [text(i) for i in range(n)]
    started = time.perf_counter()
    if together:
        bodies = [{"input": texts, "truncate": True}]
    else:
        bodies = [{"input": t, "truncate": True} for t in texts]
    replies = await asyncio.gather(*(http.post(URL, json=b) for b in bodies))
    for r in replies:
        r.raise_for_status()
    return time.perf_counter() - started


async def run(url: str, n: int, rounds: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits()) as http:
        await one_round(http, 4, False)  # warm-up: the steps' programs compiled
        out = {}
        for label, together in (("concurrent", False), ("one_request", True)):
            rates = [n / await one_round(http, n, together) for _ in range(rounds)]
            out[label] = {"best": max(rates), "median": statistics.median(rates)}
        return out


def embedding_copy(model: str, directory: Path) -> Path:
    """A copy of the GGUF ``model`` whose metadata says ``{arch}.pooling_type`` = 3 (last
    token): served beside the original, the same weights embed."""
    reader = gguf.GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    out = directory / f"{Path(model).stem}-embed.gguf"
    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    pooling = MetadataDetails(gguf.GGUFValueType.UINT32, int(gguf.PoolingType.LAST))
    copy_with_new_metadata(reader, writer, {f"{arch}.pooling_type": pooling}, [])
    return out


def gaps(samples: list[Sample]) -> dict:
    """Inter-token gaps of the streams, in milliseconds, and their first tokens'."""
    itl = np.array([g for s in samples for g in s.gaps]) * 1e3
    return {
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p95_ms": float(np.percentile(itl, 95)),
        "itl_max_ms": float(itl.max()),
        "ttft_max_ms": max(s.ttft for s in samples) * 1e3,
    }


def first_tokens(samples: list[Sample]) -> dict:
    """The first tokens' times of the requests, in milliseconds."""
    ttft = np.array([s.ttft for s in samples]) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "ttft_max_ms": float(ttft.max()),
    }


async def beside(url: str, generator: str, embedder: str, args: argparse.Namespace) -> dict:
    """Generation alone, then with embedding requests sent back to back: a stream's gaps
    (``--rounds`` streams of ``--gen-tokens``), or new requests' first tokens (``--ttft``)."""
    chat = Client(url, None, generator)
    sampling = {"ignore_eos": True}
    body = {"model": embedder, "input": [text(i) for i in range(args.requests)], "truncate": True}
    await chat.chat(question(0), 4)  # warm-up: both models loaded, their programs compiled
    (await chat.http.post(URL, json=body)).raise_for_status()

    async def generation() -> list[Sample]:
        if not args.ttft:
            return [
                await chat.chat(question(i), args.gen_tokens, sampling) for i in range(args.rounds)
            ]
        pauses, samples = random.Random(0), []
        for i in range(args.ttft):  # each arrives at another point of an embedding step
            await asyncio.sleep(pauses.uniform(0.1, 0.6))
            samples.append(await chat.chat(question(i), 2, sampling))
        return samples

    measure = first_tokens if args.ttft else gaps
    alone = await generation()
    started = time.perf_counter()  # embeddings with the generation model loaded, idle
    for _ in range(args.rounds):
        (await chat.http.post(URL, json=body)).raise_for_status()
    idle = args.rounds * args.requests / (time.perf_counter() - started)
    stop, embedded = asyncio.Event(), 0

    async def load() -> None:
        nonlocal embedded
        while not stop.is_set():
            (await chat.http.post(URL, json=body)).raise_for_status()
            embedded += args.requests

    task = asyncio.create_task(load())
    await asyncio.sleep(0.5)  # the first embedding request is in its steps
    started = time.perf_counter()
    loaded = await generation()
    seconds = time.perf_counter() - started
    stop.set()
    await task
    await chat.http.aclose()
    return {
        "alone": measure(alone),
        "embeddings_generation_idle": {"embed_inputs_per_s": idle},
        "beside_embeddings": {**measure(loaded), "embed_inputs_per_s": embedded / seconds},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pooling", choices=["mean", "cls", "last"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--beside-generation", action="store_true")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--ttft", type=int, default=0, metavar="N")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.beside_generation or args.ttft:
        with tempfile.TemporaryDirectory() as tmp:
            copy = embedding_copy(args.model, Path(tmp))
            extra = ["--cpu", *budget, str(copy)]
            with started_server(args.model, 512, 16, "f16", extra) as url:
                result = asyncio.run(beside(url, Path(args.model).stem, copy.stem, args))
        print(json.dumps(result, indent=None if args.json else 1))
        return
    extra = ["--cpu", *budget] + (["--pooling", args.pooling] if args.pooling else [])
    with started_server(args.model, 512, 16, "f16", extra) as url:
        result = asyncio.run(run(url, args.requests, args.rounds))
    if args.json:
        print(json.dumps(result))
        return
    for label, r in result.items():
        print(f"{label:12s} {args.requests} inputs: best {r['best']:.1f} inputs/s, "
              f"median {r['median']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
