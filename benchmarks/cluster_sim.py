"""The cluster router's policy at a scale this machine cannot run (issue 29, part 6).

Simulated replicas, the real router: each request is routed by `routing.Router`, the same
state and choice the Ray Serve `RequestRouter`s of `serve --replicas --router` apply
(requests in flight per replica, the approximate prefix tree capped at ``ctx x
max-num-seqs`` tokens per replica, `choose_prefix` / `choose_pow2` / `choose_round_robin`).
Only the replicas are simulated: each is a continuous-batching engine with a prefix cache
of ``ctx x max-num-seqs`` tokens in pages, least recently used pages evicted (so the
router's tree can be wrong, as on a real cluster), at most ``--max-num-seqs`` running, a
step prefilling up to ``--step-tokens`` uncached prompt tokens (chunked, as the engine's
``max_num_batched_tokens``) and decoding one token of every running sequence.

The costs of a step come from `Costs`: seconds per uncached prompt token, per cached
prompt token, and a decode step's seconds as ``base + per_seq x batch``. `MEASURED` are
this repository's engine on the 2-vCPU development host, one thread, SmolLM2-135M Q4_1,
measured by ``--measure``:

    python benchmarks/cluster_sim.py --measure /path/SmolLM2-135M-Instruct.Q4_1.gguf

The workload is issue 29's multi-tenant one: ``--systems`` system prompts of
``--system-tokens`` tokens; each request a short question (``--question-tokens``, its own
tokens) under one of them, uniformly or with ``--skew`` of the traffic on the first;
Poisson arrivals at ``--rate`` per second. Printed per router: the cached-token rate (the
replicas' own hits / prompt tokens) against the ideal (every repeat of a system prompt
cached), what the router's tree believed cached where it sent each request (above the
replicas' own rate where the tree is wrong), TTFT p50 / p99, the largest share of
requests on one replica, the prefix router's fallbacks to the least loaded and its
spreads of a hot prefix to one more replica.

    python benchmarks/cluster_sim.py                  # 64 replicas, 10,000 requests, uniform
    python benchmarks/cluster_sim.py --skew 0.8
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from serve_load import pct

from dynalm.runtime.serve.routing import POLICIES, Router


@dataclass(frozen=True)
class Costs:
    prefill_s: float  # seconds per uncached prompt token (prefill)
    cached_s: float  # seconds per prompt token found in the prefix cache
    decode_base_s: float  # a decode step: base + per_seq x sequences in the batch
    decode_per_seq_s: float

    def decode(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch


# `--measure` on the 2-vCPU host of this repository (1 thread, SmolLM2-135M Q4_1, the host
# shared with other jobs), 2026-12-05: 3.0 ms per uncached prompt token (a 512-token prompt
# cold), 0.03 ms per cached one (the same prompt, its last 16 tokens new), a decode step
# 9.96 ms at batch 1 and 56.6 ms at batch 16 (`dynalm bench -t 1 -p 512 -n 32` agrees: pp512
# 316 t/s = 3.2 ms per token, tg32 95 t/s = 10.5 ms per step)
MEASURED = Costs(prefill_s=3.0e-3, cached_s=3.1e-5, decode_base_s=6.63e-3, decode_per_seq_s=3.33e-3)


@dataclass
class Request:
    id: str
    system: int
    tokens: list[int]
    blocks: list[object]  # page keys of the prompt: chained over the system prompt's pages
    arrival: float
    max_tokens: int
    cached: int = 0
    todo: int = 0  # uncached prompt tokens still to prefill
    left: int = 0  # tokens still to decode
    first: float = 0.0  # time of the first token


@dataclass(eq=False)  # hashed by identity: the router's key for it
class Replica:
    name: str
    pages: int  # the KV cache's capacity, in pages
    page: int
    cache: OrderedDict = field(default_factory=OrderedDict)  # page key -> None, LRU first
    queue: deque = field(default_factory=deque)  # routed, not yet admitted
    running: list = field(default_factory=list)
    busy: bool = False
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def __str__(self) -> str:  # the router's tie-break orders replicas by str()
        return self.name

    def admit(self, req: Request) -> None:
        """Look the prompt up in the prefix cache (whole pages from its start) and hold
        its pages, least recently used ones evicted past the capacity."""
        hit = 0
        for key in req.blocks:
            if key not in self.cache:
                break
            hit += 1
        req.cached = min(hit * self.page, len(req.tokens) - 1)  # the last token is computed
        req.todo = len(req.tokens) - req.cached
        req.left = req.max_tokens
        self.hit_tokens += req.cached
        self.prompt_tokens += len(req.tokens)
        for key in req.blocks:
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.pages:
            self.cache.popitem(last=False)
        self.running.append(req)


@dataclass
class Workload:
    requests: list[Request]
    ideal_cached: int  # every repeat of a system prompt cached (whole pages of it)
    prompt_tokens: int


def workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)  # the same arrivals for every router
    page, st = args.page, args.system_tokens
    systems = [list(range(st * k + 1, st * (k + 1) + 1)) for k in range(args.systems)]
    chains = []  # each system prompt's page keys, chained: a page is known by its prefix
    for k in range(args.systems):
        chains.append([("s", k, i) for i in range(st // page)])
    t, seen, ideal, total = 0.0, set(), 0, 0
    requests = []
    vocab = st * args.systems + 1
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        k = 0 if rng.random() < args.skew else rng.randrange(args.systems)
        q = [vocab + rng.randrange(1 << 20) for _ in range(args.question_tokens)]
        tokens = systems[k] + q
        blocks = chains[k] + [("q", i, j) for j in range(len(tokens) // page - st // page)]
        if k in seen:
            ideal += len(chains[k]) * page
        seen.add(k)
        total += len(tokens)
        requests.append(Request(f"r{i}", k, tokens, blocks, t, args.max_tokens))
    return Workload(requests, ideal, total)


def simulate(policy: str, work: Workload, args: argparse.Namespace, costs: Costs) -> dict:
    """Route ``work`` with ``policy`` over ``args.replicas`` simulated replicas."""
    kv = args.ctx * args.max_num_seqs
    replicas = [Replica(f"replica-{i:02d}", kv // args.page, args.page)
                for i in range(args.replicas)]  # fmt: skip
    router = Router(policy, max_tokens=kv, rng=random.Random(args.seed), name=lambda r: r.name)
    events: list[tuple[float, int, int, object]] = []  # (time, order, kind, what)
    order = 0
    for req in (replace(r) for r in work.requests):  # each run's own request state
        events.append((req.arrival, order, 0, req))
        order += 1
    heapq.heapify(events)
    ttft: list[float] = []

    def start_step(rep: Replica, now: float) -> None:
        nonlocal order
        while rep.queue and len(rep.running) < args.max_num_seqs:
            rep.admit(rep.queue.popleft())
        if not rep.running:
            rep.busy = False
            return
        budget, took = args.step_tokens, 0.0
        for req in rep.running:  # chunked prefill, oldest first
            if req.todo and budget:
                n = min(req.todo, budget)
                if req.todo == len(req.tokens) - req.cached:  # its first chunk
                    took += req.cached * costs.cached_s
                took += n * costs.prefill_s
                req.todo -= n
                budget -= n
        decoding = sum(1 for req in rep.running if not req.todo)
        took += costs.decode(decoding) if decoding else 0.0
        rep.busy = True
        heapq.heappush(events, (now + took, order, 1, rep))
        order += 1

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == 0:  # an arrival: the router's choice, the first replica of its order
            req = what
            assert isinstance(req, Request)
            rep = router.choose(replicas, req.tokens)[0]
            router.routed(rep, req.id, req.tokens)
            rep.queue.append(req)
            if not rep.busy:
                start_step(rep, now)
            continue
        rep = what
        assert isinstance(rep, Replica)
        still = []
        for req in rep.running:  # the step that just ended
            if req.todo:
                still.append(req)
                continue
            if not req.first:
                req.first = now  # prefill's last chunk samples the first token
                ttft.append(now - req.arrival)
            req.left -= 1
            if req.left > 0:
                still.append(req)
            else:
                router.completed(rep, req.id)
        rep.running = still
        start_step(rep, now)

    hits = sum(r.hit_tokens for r in replicas)
    routed = router.stats.routed
    return {
        "router": policy,
        "requests": sum(routed.values()),
        "cached": hits / work.prompt_tokens,
        "ideal": work.ideal_cached / work.prompt_tokens,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "max_share": max(routed.values()) / len(work.requests),
        "fallbacks": router.stats.load_fallbacks,
        "spreads": router.stats.hot_spreads,
        "tree_matched": router.stats.matched_tokens / max(router.stats.prompt_tokens, 1),
    }


def measure(path: str) -> Costs:
    """The cost constants of this host's engine, one thread: prefill of a 512-token prompt
    cold, then again with all but its last 16 tokens cached, and decode steps at batch 1
    and 16 (their slope is the per-sequence cost)."""
    from dynalm.core.cpu_device import CpuDevice
    from dynalm.models.loader import load_model
    from dynalm.runtime.engine.config import EngineConfig
    from dynalm.runtime.engine.engine import Engine
    from dynalm.runtime.engine.sampling import SamplingParams

    model = load_model(path)
    engine = Engine(model, CpuDevice("auto", threads=1), EngineConfig(ctx=1024, max_num_seqs=16))
    one = SamplingParams(max_tokens=1, temperature=0)
    ids = iter(range(1 << 30))

    def prefill(prompt: list[int]) -> float:
        engine.add_request(f"m{next(ids)}", prompt, one, stop_ids=frozenset())
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    base = [1000 + (i * 7919) % 20000 for i in range(512)]
    prefill(base[:64])  # warm up
    cold = min(prefill([base[0] + r + 1, *base[1:]]) for r in range(3))  # a new first token
    prefill(base)
    warm = min(prefill([*base[:496], *[t + 1 + r for t in base[496:]]]) for r in range(3))
    prefill_s = cold / 512
    cached_s = max(warm - 16 * prefill_s, 0.0) / 496

    def step_time(batch: int) -> float:
        many = SamplingParams(max_tokens=40, temperature=0)  # no stop ids: all 40
        for b in range(batch):
            engine.add_request(f"m{next(ids)}", [5000 + b, *base[:8]], many, stop_ids=frozenset())
        for _ in range(4):  # prefill and settle into decode
            engine.step()
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        return (time.perf_counter() - t0) / n

    one_seq, sixteen = min(step_time(1) for _ in range(2)), min(step_time(16) for _ in range(2))
    per_seq = (sixteen - one_seq) / 15
    return Costs(prefill_s, cached_s, one_seq - per_seq, per_seq)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--routers", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", metavar="GGUF", help="measure the cost constants, then exit")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure).__dict__))
        return
    work = workload(args)
    print(f"{args.replicas} replicas, {args.requests} requests, {args.systems} system prompts "
          f"x {args.system_tokens} tokens, skew {args.skew}, {args.rate}/s")  # fmt: skip
    print(f"costs: {MEASURED}")
    print("router        cached  believed   ideal  TTFT p50  TTFT p99  max share  fallbacks  "
          "spreads  wall")  # fmt: skip
    for policy in args.routers.split(","):
        t0 = time.perf_counter()
        r = simulate(policy, work, args, MEASURED)
        wall = time.perf_counter() - t0
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{policy:12} {r['cached']:6.1%}  {r['tree_matched']:8.1%}  {r['ideal']:6.1%}  "
              f"{r['ttft_p50']:7.3f}s {r['ttft_p99']:8.3f}s  {r['max_share']:8.1%}  "
              f"{r['fallbacks']:9d}  {r['spreads']:7d}  {wall:4.1f}s")  # fmt: skip


if __name__ == "__main__":
    main()
