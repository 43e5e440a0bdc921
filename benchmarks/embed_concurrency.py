"""Embedding throughput under concurrency: ``--requests`` single-input ``/v1/embeddings``
requests sent at once (distinct texts of about 8-16 words), inputs/s over the wall time of
each round; and, for comparison, the same inputs as one request. Starts `dynalm serve` on a
loopback port (``--pooling`` passed on: a generation model embeds with it).

    python benchmarks/embed_concurrency.py --model tiny-bert.gguf
    python benchmarks/embed_concurrency.py --model SmolLM2-135M-Instruct.Q4_1.gguf --pooling last
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from serve_load import TOPICS, started_server

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pooling", choices=["mean", "cls", "last"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    extra = ["--cpu"] + (["--pooling", args.pooling] if args.pooling else [])
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
