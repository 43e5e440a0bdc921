"""Routing quality of `dynalm serve --replicas` (issue 29): a multi-tenant workload against
``--router prefix``, ``pow2`` and ``round-robin``, the same replicas, one run.

``--systems`` long system prompts (``--system-tokens`` each); each request is a short
question under one of them (one system prompt gets ``--skew`` of the traffic, the rest
share the remainder evenly), arriving as a Poisson process at ``--rate`` per second. For
each router: the cached-token rate (the replicas' own prefix-cache counters: hit tokens /
prompt tokens looked up), the ideal rate (every repeat of a system prompt cached), TTFT
p50 / p99, output tokens/s, and the largest share of requests one replica got. On a small
machine run 2 replicas of 1 thread: what it measures is routing, not throughput.

The defaults are the case where routing matters: each replica's KV cache (``--ctx`` x
``--max-num-seqs`` = 8,192 tokens, or ``--kv-cache-memory``) holds about 5 of the 8
system prompts of 1,500 tokens, so the working set (12,000 tokens) fits the 2 replicas
only when partitioned: a replica sent every prompt (round-robin, pow2) evicts and prefills
them again; one sent only its half (prefix) keeps them. With caches that hold every
prompt, every router caches well and the comparison says little. The rate, 0.5/s, keeps
the replicas busy but not swamped: an uncached prompt is 1,500 tokens of prefill, about
4.5 s on one thread of the development host (3 ms a token: `cluster_sim.MEASURED`), so
round-robin's misses keep each replica about half busy.

    python benchmarks/cluster_load.py --model /path/model.gguf
    python benchmarks/cluster_load.py --model M --routers prefix,round-robin --skew 0.8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time

import httpx
from serve_load import Client, long_system, pct, question, started_server

ROUTERS = ("prefix", "pow2", "round-robin")


def scrape(text: str, name: str) -> dict[str, float]:
    """The samples of counter/gauge ``name``, by their replica label."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = re.search(r'replica="([^"]+)"', line).group(1)  # type: ignore[union-attr]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


async def run_router(url: str, args: argparse.Namespace, systems: list[dict]) -> dict:
    client = Client(url, None, "m")
    client.model = (await client.http.get("/v1/models")).json()["data"][0]["id"]
    rng = random.Random(args.seed)  # the same arrivals and choices for every router
    picks = [0 if rng.random() < args.skew else rng.randrange(1, len(systems))
             for _ in range(args.requests)]  # fmt: skip
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    samples, errors = [], 0

    async def one(i: int) -> None:
        nonlocal errors
        try:
            samples.append(await client.chat([systems[picks[i]], *question(i)], args.max_tokens))
        except Exception as e:  # counted, and the first few shown
            errors += 1
            if errors <= 3:
                print(f"  request {i}: {e}")

    t0 = time.perf_counter()
    tasks = []
    for i in range(args.requests):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gaps[i])
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t0
    await asyncio.sleep(3)  # the replicas' stats reach the ingress within ~2 polls of 1 s
    metrics = (await client.http.get("/metrics")).text
    await client.http.aclose()
    queried = sum(scrape(metrics, "dynalm:prefix_cache_queries_total").values())
    hits = sum(scrape(metrics, "dynalm:prefix_cache_hits_total").values())
    routed = scrape(metrics, "dynalm:router_requests_total")
    # ideal: every request after the first under its system prompt finds it cached
    ideal = sum(args.system_tokens for i, k in enumerate(picks) if k in picks[:i])
    ttft = [s.ttft for s in samples]
    return {
        "requests": len(samples),
        "errors": errors,
        "cached_rate": hits / queried if queried else float("nan"),
        "ideal_rate": ideal / queried if queried else float("nan"),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tokens_per_s": sum(s.tokens for s in samples) / seconds,
        "max_share": max(routed.values()) / sum(routed.values()) if routed else float("nan"),
    }


async def systems_of(url: str, n: int, tokens: int) -> list[dict]:
    client = Client(url, None, "m")
    out = [await long_system(client, tokens) for _ in range(n)]
    await client.http.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="per replica")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    p.add_argument("--skew", type=float, default=0.0, help="share of system prompt 0")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument(
        "--kv-cache-memory", help="each replica's KV pool, e.g. 64MiB (default: ctx x max-num-seqs)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    extra = ["--replicas", str(args.replicas), "--threads", str(args.threads)]
    if args.kv_cache_memory:
        extra += ["--kv-cache-memory", args.kv_cache_memory]
    results, systems = {}, None
    for router in args.routers.split(","):
        flags = [*extra, "--router", router]
        with started_server(args.model, args.ctx, args.max_num_seqs, "f16", flags) as url:
            httpx.get(url + "/v1/models", timeout=60)
            systems = systems or asyncio.run(systems_of(url, args.systems, args.system_tokens))
            results[router] = asyncio.run(run_router(url, args, systems))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.replicas} replicas x {args.threads} thread(s), {args.systems} system prompts "
          f"x {args.system_tokens} tokens, {args.requests} requests at {args.rate}/s, "
          f"skew {args.skew}, ctx {args.ctx} x {args.max_num_seqs} seqs, "
          f"KV {args.kv_cache_memory or 'ctx x seqs'}")  # fmt: skip
    print(f"{'router':12} {'cached':>7} {'ideal':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'tok/s':>7} {'max share':>9} {'errors':>6}")  # fmt: skip
    for router, r in results.items():
        print(f"{router:12} {r['cached_rate']:7.1%} {r['ideal_rate']:7.1%} "
              f"{r['ttft_p50_s']:8.3f}s {r['ttft_p99_s']:8.3f}s {r['tokens_per_s']:7.1f} "
              f"{r['max_share']:9.1%} {r['errors']:6d}")  # fmt: skip


if __name__ == "__main__":
    main()
