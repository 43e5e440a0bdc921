"""Prometheus metrics of one server, with vLLM's names under a ``dynalm:`` prefix.

Latencies and token counts are observed by the server as outputs reach it (what a
client sees); the engine's state (running / waiting requests, KV usage, prefix-cache
counters) is read from ``engine.stats`` at scrape time, so it is never stale and the
engine needs no metrics code. The process's own (``process_resident_memory_bytes``, CPU,
open files) come from prometheus_client. Each model has its own registry (so several
servers in one process, tests, never share counters); `render` merges those of the loaded
models into one exposition: one HELP/TYPE per metric, the models told apart by their
``model_name`` label, the process's own metrics once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dynalm.runtime.engine.engine import Engine, EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.3, 0.5, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 60, 120, 240, 480, 960, 1920)


_ENGINE_ROWS = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
     lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be admitted.",
     lambda s: s.num_waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).",
     lambda s: s.kv_usage),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_queried_tokens),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_hit_tokens),
)  # fmt: skip
_SPEC_ROWS = (  # speculative decoding's
    (CounterMetricFamily, "spec_decode_num_drafts", "Drafts verified.",
     lambda s: s.spec.num_drafts),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens verified.",
     lambda s: s.spec.num_draft_tokens),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     lambda s: s.spec.num_accepted_tokens),
)  # fmt: skip


def engine_metrics(
    labels: Sequence[str], samples: Sequence[tuple[Sequence[str], EngineStats]], spec: bool
) -> Iterator[Metric]:
    """The engine's gauges and counters, a sample for each (label values, stats): one
    engine's, or a cluster's replicas'."""
    for family, name, doc, value in _ENGINE_ROWS + (_SPEC_ROWS if spec else ()):
        metric = family(f"dynalm:{name}", doc, labels=list(labels))
        for values, stats in samples:
            metric.add_metric(list(values), value(stats))
        yield metric


class _EngineCollector(Collector):
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        spec = self.engine.planner is not None
        yield from engine_metrics(["model_name"], [([self.model_name], stats)], spec)
        if spec:
            lengths = HistogramMetricFamily(
                "dynalm:spec_decode_acceptance_length",
                "Draft tokens accepted per verified draft.",
                labels=["model_name"],
            )
            cumulative = np.cumsum(stats.spec.accepted_lengths).tolist()
            buckets = [(str(n), c) for n, c in enumerate(cumulative)] + [("+Inf", cumulative[-1])]
            lengths.add_metric([self.model_name], buckets, stats.spec.num_accepted_tokens)
            yield lengths


class _Merged(Collector):
    """The metrics of several registries as one: each family once, with every registry's
    samples (told apart by their labels)."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(family.samples)
        yield from families.values()


_PROCESS = CollectorRegistry()
ProcessCollector(registry=_PROCESS)  # process_resident_memory_bytes, CPU, fds: once a process


def render(metrics: Sequence[ServerMetrics]) -> bytes:
    """The Prometheus exposition of the process and of each of ``metrics`` (the loaded
    models)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([_PROCESS, *(m.registry for m in metrics)]))
    return generate_latest(registry)


class ServerMetrics:
    """The registry of one model's engine and the per-request observations it makes."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine_collector: Collector = _EngineCollector(engine, model_name)
        self.registry.register(self.engine_collector)
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"dynalm:{name}", doc, label, buckets=buckets, registry=self.registry
            ).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"dynalm:{name}", doc, label, registry=self.registry).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first token.", _TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last output.", _E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(
            "dynalm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def track(self) -> RequestTracker:
        """Start observing one engine request (call at arrival)."""
        return RequestTracker(self)

    def render(self) -> bytes:
        return render([self])


class RequestTracker:
    """Turns one request's stream of outputs into latency and token observations."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.seen = False
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.perf_counter()
        if not self.seen:
            self.seen = True
            m.prompt_tokens.inc(out.prompt_tokens)
        new = out.completion_tokens - self.tokens
        if new > 0:
            if self.tokens == 0:
                m.ttft.observe(now - self.start)
            else:
                for _ in range(new):  # an output carrying several tokens: spread the gap
                    m.itl.observe((now - self.last) / new)
            m.generation_tokens.inc(new)
            self.tokens, self.last = out.completion_tokens, now
        if out.finished:
            self._finish(out.finish_reason or "stop", now)

    def aborted(self) -> None:
        """The consumer went away before the request finished."""
        if not self.done:
            self._finish("abort", time.perf_counter())

    def _finish(self, reason: str, now: float) -> None:
        self.done = True
        self.metrics.e2e.observe(now - self.start)
        self.metrics.finished(reason)
