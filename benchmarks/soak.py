"""Soak a DynaLM server: many mixed requests at once, then check that nothing was lost.

By default 1,000 chat requests at concurrency 32, all behind one long system prompt (shared
through the prefix cache): streamed or not, greedy or sampled with one of a few seeds, and a
quarter of them streams that the client drops after two content chunks. Every request asks
for logprobs, so each token an answer carries is counted. Checks:

- every response is a 200 (no 5xx, no 503);
- every answer that ran to its end is complete: a finish_reason (stop or length), streams
  end with ``[DONE]`` and no error event, ``completion_tokens`` equals the tokens received,
  and "length" means exactly ``max_tokens``;
- one prompt, one text: greedy answers to the same question are identical, and so are
  sampled answers with the same seed;
- afterwards the engine is idle and no KV page is held by a request
  (``dynalm:kv_cache_usage_perc`` 0); the server's RSS before and after is printed.

    python benchmarks/soak.py --model /path/model.gguf        # starts `dynalm serve`
    python benchmarks/soak.py --url http://127.0.0.1:8000 [--requests 1000 --concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_load import LOOPBACK, TOPICS, Client, started_server

SYSTEM = "You are the concise help desk of a large public library. " + " ".join(
    f"Note {i}: books about {TOPICS[i % len(TOPICS)]} are on shelf {i}." for i in range(40)
)
QUESTIONS = [f"Where do I find books about {topic}?" for topic in TOPICS[:8]]
SEEDS = (1, 2, 3)


@dataclass
class Job:
    """One request of the soak: what it asks and how it is sent."""

    question: int
    stream: bool
    seed: int | None  # None: greedy
    cancel: bool  # a stream the client leaves after two content chunks


@dataclass
class Outcome:
    job: Job
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    tokens_received: int = 0
    done: bool = False  # the stream ended with [DONE]
    errors: list[str] = field(default_factory=list)


def plan(n: int, seed: int = 0) -> list[Job]:
    """``n`` jobs in a shuffled order: every fourth a dropped stream, the rest half streamed
    and half greedy."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        cancel = i % 4 == 3
        jobs.append(
            Job(
                question=rng.randrange(len(QUESTIONS)),
                stream=cancel or rng.random() < 0.5,
                seed=None if rng.random() < 0.5 else rng.choice(SEEDS),
                cancel=cancel,
            )
        )
    rng.shuffle(jobs)
    return jobs


async def send(client: Client, job: Job, max_tokens: int) -> Outcome:
    """Send one job and record what came back."""
    out = Outcome(job)
    body = {
        "model": client.model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[job.question]},
        ],
        "max_tokens": max_tokens,
        "temperature": 0 if job.seed is None else 0.8,
        "seed": job.seed,
        "logprobs": True,
        "stream": job.stream,
    }
    if not job.stream:
        r = await client.http.post("/v1/chat/completions", json=body)
        out.status = r.status_code
        if r.status_code != 200:
            out.errors.append(r.text[:200])
            return out
        answer = r.json()
        choice = answer["choices"][0]
        out.text, out.finish_reason = choice["message"]["content"], choice["finish_reason"]
        out.tokens_received = len((choice["logprobs"] or {}).get("content") or [])
        out.completion_tokens = answer["usage"]["completion_tokens"]
        return out
    body["stream_options"] = {"include_usage": True}
    async with client.http.stream("POST", "/v1/chat/completions", json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.errors.append((await r.aread()).decode()[:200])
            return out
        contents = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(chunk["error"]["message"])
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    out.text += choice["delta"].get("content") or ""
                    out.tokens_received += len((choice["logprobs"] or {}).get("content") or [])
                    out.finish_reason = choice["finish_reason"] or out.finish_reason
                    contents += bool(choice["delta"].get("content"))
            if job.cancel and contents == 2:
                break  # leaving the block closes the connection mid-stream
    return out


def check(outcomes: list[Outcome], max_tokens: int) -> list[str]:
    """What went wrong, one line each (empty when every answer is whole and consistent)."""
    problems = []
    same: dict[tuple[int, int | None], set[str]] = defaultdict(set)
    for i, out in enumerate(outcomes):
        job, where = out.job, f"request {i} ({'stream' if out.job.stream else 'json'})"
        if out.status != 200 or out.errors:
            problems.append(f"{where}: HTTP {out.status} {out.errors[:1]}")
            continue
        if job.cancel:
            continue
        if out.finish_reason not in ("stop", "length"):
            problems.append(f"{where}: finish_reason {out.finish_reason!r}")
        if job.stream and not out.done:
            problems.append(f"{where}: the stream did not end with [DONE]")
        if out.completion_tokens != out.tokens_received:
            problems.append(
                f"{where}: usage says {out.completion_tokens} tokens, {out.tokens_received} came"
            )
        n = out.completion_tokens or 0
        if n > max_tokens or (out.finish_reason == "length" and n != max_tokens):
            problems.append(f"{where}: {out.finish_reason} after {n} of {max_tokens} tokens")
        same[(job.question, job.seed)].add(out.text)
    for (question, seed), texts in same.items():
        if len(texts) > 1:
            kind = "greedy" if seed is None else f"seed {seed}"
            problems.append(f"question {question}, {kind}: {len(texts)} different answers")
    return problems


async def server_state(http: httpx.AsyncClient) -> dict[str, float]:
    """The engine gauges and the RSS from /metrics, by sample name."""
    text = (await http.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def settle(http: httpx.AsyncClient, timeout: float = 60) -> dict[str, float]:
    """Wait until no request runs or waits (aborts land at the next engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        state = await server_state(http)
        busy = state["dynalm:num_requests_running"] + state["dynalm:num_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


@dataclass
class SoakResult:
    requests: int
    cancelled: int
    seconds: float
    completion_tokens: int
    rss_before: float
    rss_after: float
    kv_usage_after: float
    problems: list[str]

    def summary(self) -> str:
        mb = 1 << 20
        return (
            f"{self.requests} requests ({self.cancelled} dropped mid-stream) in "
            f"{self.seconds:.1f} s, {self.completion_tokens / self.seconds:.0f} tokens/s; "
            f"server RSS {self.rss_before / mb:.0f} -> {self.rss_after / mb:.0f} MiB; "
            f"KV in use afterwards {self.kv_usage_after:.0%}; {len(self.problems)} problems"
        )


async def soak(
    url: str,
    *,
    requests: int = 1000,
    concurrency: int = 32,
    max_tokens: int = 24,
    api_key: str | None = None,
    seed: int = 0,
) -> SoakResult:
    if urlparse(url).hostname not in LOOPBACK:
        raise SystemExit(f"refusing {url}: the soak only targets loopback addresses")
    probe = Client(url, api_key, "")
    model = (await probe.http.get("/v1/models")).json()["data"][0]["id"]
    client = Client(url, api_key, model)
    before = await settle(client.http)
    jobs = iter(plan(requests, seed))
    outcomes: list[Outcome] = []

    async def worker() -> None:
        for job in jobs:
            try:
                outcomes.append(await send(client, job, max_tokens))
            except httpx.HTTPError as e:
                outcomes.append(Outcome(job, errors=[f"{type(e).__name__}: {e}"]))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    after = await settle(client.http)
    problems = check(outcomes, max_tokens)
    if after["dynalm:num_requests_running"] or after["dynalm:num_requests_waiting"]:
        problems.append("requests still running or waiting after the soak")
    if after["dynalm:kv_cache_usage_perc"]:
        problems.append(f"KV pages still held: {after['dynalm:kv_cache_usage_perc']:.1%}")
    return SoakResult(
        requests=len(outcomes),
        cancelled=sum(o.job.cancel for o in outcomes),
        seconds=seconds,
        completion_tokens=sum(o.completion_tokens or 0 for o in outcomes),
        rss_before=before["process_resident_memory_bytes"],
        rss_after=after["process_resident_memory_bytes"],
        kv_usage_after=after["dynalm:kv_cache_usage_perc"],
        problems=problems,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start `dynalm serve MODEL` for the run")
    ap.add_argument("--api-key")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0, help="of the request mix")
    ap.add_argument("--ctx", type=int, default=2048, help="with --model")
    ap.add_argument("--kv-cache-dtype", default="f16", help="with --model: f16 | f32 | q8_0")
    args = ap.parse_args()
    kw = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "api_key": args.api_key,
        "seed": args.seed,
    }
    if args.url:
        result = asyncio.run(soak(args.url.rstrip("/"), **kw))
    else:
        with started_server(args.model, args.ctx, 16, args.kv_cache_dtype) as url:
            result = asyncio.run(soak(url, **kw))
    print(result.summary())
    for problem in result.problems[:20]:
        print(f"  {problem}")
    sys.exit(1 if result.problems else 0)


if __name__ == "__main__":
    main()
