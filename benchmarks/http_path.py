"""What the HTTP path costs a single stream: decode tokens/s over the OpenAI API against
`dynalm bench`'s tg on the same machine, alternated run by run.

Each round runs ``dynalm bench MODEL -p 0 -n N -r 1`` (the engine alone: N greedy decode
steps after an 8-token prompt), then the same through a running ``dynalm serve``: one
streamed ``/v1/completions`` request of 8 prompt token ids and N + 1 tokens
(``ignore_eos``), greedy and at the OpenAI defaults (temperature 1, top_p 1), timed from its
first content chunk to its last, as the client sees them. The server starts once, before
the rounds, and idles while bench runs.

    python benchmarks/http_path.py --model /path/model.gguf [-n 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx
from serve_load import started_server

PROMPT = [1, 504, 3000, 77, 9001, 12, 400, 33]  # 8 token ids, as bench's tg prompt


def bench_tg(model: str, n: int, threads: int | None) -> float:
    cmd = [sys.executable, "-m", "dynalm.cli", "bench", model, "-p", "0", "-n", str(n)]
    cmd += ["-r", "1", "--json", *(["-t", str(threads)] if threads else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["results"][0]["tokens_per_s"]


def http_tg(client: httpx.Client, n: int, temperature: float) -> float:
    """Decode tokens/s of one streamed request, first content chunk to last."""
    body = {
        "prompt": PROMPT,
        "max_tokens": n + 1,
        "temperature": temperature,
        "top_p": 1.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps, tokens = [], 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c["text"] for c in chunk["choices"]):
                stamps.append(time.perf_counter())
    return (tokens - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=128, help="decode tokens per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, help="passed to bench and serve")
    args = ap.parse_args()
    extra = ["--threads", str(args.threads)] if args.threads else []
    with started_server(args.model, 1024, 4, "f16", extra) as url:
        client = httpx.Client(base_url=url, timeout=600)
        http_tg(client, 8, 0.0)  # warm-up: kernels, first pages
        rows = []
        print(f"{'round':>5} {'bench tg':>9} {'http greedy':>12} {'http T=1':>9}  (tokens/s)")
        for i in range(args.rounds):
            row = (
                bench_tg(args.model, args.n, args.threads),
                http_tg(client, args.n, 0.0),
                http_tg(client, args.n, 1.0),
            )
            rows.append(row)
            print(f"{i + 1:>5} {row[0]:>9.1f} {row[1]:>12.1f} {row[2]:>9.1f}")
    bench, greedy, sampled = (statistics.median(col) for col in zip(*rows, strict=True))
    print(
        f"median: bench tg{args.n} {bench:.1f}, http greedy {greedy:.1f} ({greedy / bench:.2f}x),"
        f" http temperature 1 {sampled:.1f} ({sampled / bench:.2f}x)"
    )


if __name__ == "__main__":
    main()
