"""Load on a DynaLM server over loopback: throughput and latency under concurrency, and
what the prefix cache does to time-to-first-token.

Streamed chat requests (distinct questions) at each concurrency level, for each sampling
setting (``--temperature``: greedy and the OpenAI defaults, temperature 1 and top_p 1, by
default): aggregate output tokens/s (exact, from the usage chunk), time to first token and
inter-token latency (gaps between content chunks) at p50 / p95, and the throughput ratio
of 8 concurrent to 1. Then TTFT with a cached ~1,000-token shared prefix vs the same length
uncached (ratio). Bounded: each level sends at most ``--requests`` requests and stops
issuing new ones after ``--level-seconds``; only 127.0.0.1 / localhost / ::1 targets.

    python benchmarks/serve_load.py --model /path/model.gguf   # starts `dynalm serve`
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 [--api-key KEY] [--json]
    python benchmarks/serve_load.py --model M --temperature 0.8 --top-p 0.95
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOPICS = [
    "the sea", "volcanoes", "bread", "owls", "trains", "glaciers", "chess", "bees",
    "copper", "rain", "maps", "violins", "deserts", "clocks", "salt", "comets",
]  # fmt: skip


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class Level:
    concurrency: int
    requests: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    errors: int = 0
    notes: list[str] = field(default_factory=list)


class Client:
    def __init__(self, url: str, api_key: str | None, model: str) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits)
        self.model = model

    async def chat(
        self, messages: list[dict], max_tokens: int, sampling: dict | None = None
    ) -> Sample:
        """One streamed chat request (greedy unless ``sampling`` says otherwise: e.g.
        ``{"temperature": 1.0, "top_p": 1.0}``), timed from the client's side."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            **(sampling or {}),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
        if not stamps:
            raise RuntimeError("no content in the stream")
        return Sample(stamps[0] - t0, list(np.diff(stamps)), tokens)


def question(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Write a short paragraph about {topic} (#{i})."}]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_level(
    client: Client,
    concurrency: int,
    n_requests: int,
    max_tokens: int,
    seconds: float,
    sampling: dict | None = None,
    first: int = 0,
) -> Level:
    """``n_requests`` requests, ``concurrency`` at a time, none started after ``seconds``;
    questions numbered from ``first`` (a number asked before would hit the prefix cache)."""
    samples: list[Sample] = []
    errors: list[str] = []
    counter = iter(range(first, first + n_requests))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in counter:
            if time.perf_counter() - t0 > seconds:
                return
            try:
                samples.append(await client.chat(question(i), max_tokens, sampling))
            except (RuntimeError, httpx.HTTPError) as e:
                errors.append(str(e))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    gaps = [g for s in samples for g in s.gaps]
    return Level(
        concurrency=concurrency,
        requests=len(samples),
        seconds=wall,
        tokens_per_s=sum(s.tokens for s in samples) / wall,
        ttft_p50=pct([s.ttft for s in samples], 50),
        ttft_p95=pct([s.ttft for s in samples], 95),
        itl_p50=pct(gaps, 50),
        itl_p95=pct(gaps, 95),
        errors=len(errors),
        notes=errors[:3],
    )


async def long_system(client: Client, n_tokens: int) -> dict:
    """A system message of about ``n_tokens`` tokens, unique per call (so never cached)."""
    words = [TOPICS[i % len(TOPICS)].split()[-1] for i in range(n_tokens)]
    message = {"role": "system", "content": ""}
    for _ in range(3):  # words are not tokens: rescale to the tokenizer's count
        message["content"] = f"[{uuid.uuid4().hex}] Reference notes: {' '.join(words)}."
        r = await client.http.post("/tokenize", json={"messages": [message]})
        count = r.json()["count"]
        words = (words * 2)[: max(1, round(len(words) * n_tokens / count))]
    return message


async def prefix_ttft(client: Client, prefix_tokens: int, rounds: int) -> dict[str, float]:
    """TTFT of a request whose long system prompt is new (uncached) vs the same system
    prompt again with another question (cached prefix); medians over ``rounds``."""
    uncached, cached = [], []
    for r in range(rounds):
        system = await long_system(client, prefix_tokens)
        first = await client.chat([system, *question(2 * r)], 4)
        again = await client.chat([system, *question(2 * r + 1)], 4)
        uncached.append(first.ttft)
        cached.append(again.ttft)
    u, c = float(np.median(uncached)), float(np.median(cached))
    return {"uncached_ttft_s": u, "cached_ttft_s": c, "ratio": c / u}


@contextmanager
def started_server(
    model: str, ctx: int, max_num_seqs: int, kv_dtype: str, extra: Sequence[str] = ()
) -> Iterator[str]:
    """`dynalm serve` on a free loopback port (``extra``: more flags); SIGTERM when done."""
    with tempfile.TemporaryFile("w+") as log:
        cmd = [sys.executable, "-m", "dynalm.cli", "serve", model, "--port", "0"]
        cmd += ["--ctx", str(ctx), "--max-num-seqs", str(max_num_seqs)]
        cmd += ["--kv-cache-dtype", kv_dtype, *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 300
            while True:
                log.seek(0)
                text = log.read()
                if m := re.search(r"on (http://\S+)/v1", text):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{text}")
                time.sleep(0.2)
            yield m.group(1)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


async def benchmark(url: str, args: argparse.Namespace) -> dict:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"refusing {url}: this benchmark only targets loopback addresses")
    probe = Client(url, args.api_key, "")
    models = (await probe.http.get("/v1/models")).json()["data"]
    client = Client(url, args.api_key, models[0]["id"])
    await client.chat(question(0), 4)  # warm-up: kernels compiled, first pages touched
    settings, asked = [], 1  # question 0 was the warm-up
    for temperature in args.temperature:
        sampling = {"temperature": temperature, "top_p": args.top_p}
        levels = []
        for concurrency in args.concurrency:
            n = min(args.requests, max(8, 4 * concurrency))
            level = await run_level(
                client, concurrency, n, args.max_tokens, args.level_seconds, sampling, asked
            )
            asked += n
            levels.append(level)
            print(
                f"  temperature {temperature}, concurrency {concurrency}: "
                f"{level.tokens_per_s:.1f} tokens/s",
                file=sys.stderr,
            )
        by = {lv.concurrency: lv.tokens_per_s for lv in levels}
        settings.append(
            {
                "sampling": sampling,
                "levels": [asdict(lv) for lv in levels],
                "throughput_8_vs_1": by[8] / by[1] if by.get(1) and 8 in by else None,
            }
        )
    prefix = await prefix_ttft(client, args.prefix_tokens, args.prefix_rounds)
    return {
        "url": url,
        "model": client.model,
        "max_tokens": args.max_tokens,
        "settings": settings,
        "prefix": {"tokens": args.prefix_tokens, **prefix},
    }


def print_table(result: dict) -> None:
    ms = 1000
    for setting in result["settings"]:
        sampling = setting["sampling"]
        kind = "greedy" if sampling["temperature"] == 0 else "sampled"
        print(
            f"model {result['model']}, {kind} chat (temperature {sampling['temperature']}, "
            f"top_p {sampling['top_p']}), max_tokens {result['max_tokens']}"
        )
        print(
            f"{'conc':>5} {'reqs':>5} {'errors':>6} {'out tok/s':>10} {'TTFT p50':>9} "
            f"{'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}   (ms)"
        )
        for lv in setting["levels"]:
            print(
                f"{lv['concurrency']:>5} {lv['requests']:>5} {lv['errors']:>6} "
                f"{lv['tokens_per_s']:>10.1f} {lv['ttft_p50'] * ms:>9.0f} "
                f"{lv['ttft_p95'] * ms:>9.0f} {lv['itl_p50'] * ms:>8.0f} {lv['itl_p95'] * ms:>8.0f}"
            )
        if setting["throughput_8_vs_1"] is not None:
            print(f"aggregate throughput, 8 concurrent vs 1: {setting['throughput_8_vs_1']:.2f}x")
        print()
    p = result["prefix"]
    print(
        f"TTFT with a cached {p['tokens']}-token prefix: {p['cached_ttft_s'] * ms:.0f} ms vs "
        f"{p['uncached_ttft_s'] * ms:.0f} ms uncached = {p['ratio']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start `dynalm serve MODEL` for the run")
    ap.add_argument("--api-key", default=os.environ.get("DYNALM_API_KEY"))
    ap.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32],
        help="levels, comma-separated (default 1,8,32)",
    )
    ap.add_argument(
        "--temperature",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 1.0],
        help="sampling settings to run, comma-separated (default 0,1: greedy and OpenAI's)",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="with every temperature")
    ap.add_argument("--requests", type=int, default=64, help="most requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--level-seconds", type=float, default=120, help="no new request after")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefix-rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048, help="with --model")
    ap.add_argument("--kv-cache-dtype", default="f16", help="with --model: f16 | f32 | q8_0")
    ap.add_argument("--json", help="also write the results to this file ('-': stdout)")
    args = ap.parse_args()

    def run(url: str) -> dict:
        return asyncio.run(benchmark(url, args))

    if args.url:
        result = run(args.url.rstrip("/"))
    else:
        server = (args.model, args.ctx, max(args.concurrency), args.kv_cache_dtype)
        with started_server(*server) as url:
            result = run(url)
    print_table(result)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
