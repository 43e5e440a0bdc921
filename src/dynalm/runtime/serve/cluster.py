"""``dynalm serve --replicas N``: many engines behind one OpenAI endpoint, on Ray Serve.

Each replica is a Ray Serve deployment replica holding one `ModelService` (the engine and
flags `serve` builds; its threads = the replica actor's ``num_cpus``). The ingress is the
ordinary `OpenAIServer` in the driver process: its model service (`ClusterModelService`)
tokenizes, templates and formats as the single-process server does, and only the narrowest
interface crosses to a replica, `AsyncEngine.generate` (token ids and sampling parameters
in, `RequestOutput`s streamed back). So every endpoint, error and header is the single
process's own; the ingress holds the tokenizer (the GGUF is mapped, its weights never
read), which also lets the router see token prefixes.

Faults: a replica that dies before a request produced output gets it retried on another
(`RemoteEngine.generate`); one that dies mid-stream ends that stream with `ReplicaLost`
(the server's error event, then ``[DONE]``). Ray Serve restarts the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynalm.core import weight_pages
from dynalm.errors import ClusterUnavailable, InvalidRequest, QueueFull, ReplicaLost
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import EngineStats, RequestOutput
from dynalm.runtime.engine.guided import GrammarCompiler, Guide
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.engine.spec_decode.stats import SpecStats
from dynalm.runtime.serve import routing
from dynalm.runtime.serve.metrics import engine_metrics
from dynalm.runtime.serve.models import ModelService
from dynalm.runtime.serve.routing import POLICIES

APP = "dynalm"
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # a local cluster's: outputs are small, the box is not
CONNECT_TIMEOUT_S = 5.0  # a TCP connection to --ray-address
JOIN_TIMEOUT_S = 30.0  # ray.init on it: joining a live cluster takes seconds, ray:// included
# what a replica inherits: dynalm as this process imports it (a source checkout included),
# the store, the Hub it pulls from, its token and timeout (on a node whose store lacks the
# model), the BLAS threads `serve --threads` set, where the weights lie (`--weight-pages`),
# the kernels' ISA and the JIT and repack caches. (A local cluster's workers inherit this
# process's whole environment anyway; a joined cluster's nodes were started without it.)
ENV = ("PYTHONPATH", "DYNALM_HOME", "HF_ENDPOINT", "HF_TOKEN", "DYNALM_PULL_TIMEOUT",
       "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", weight_pages.VARIABLE,
       "DYNALM_ISA", "DYNALM_CACHE", "DYNALM_REPACK_CACHE", "DYNALM_REPACK_CACHE_MAX")  # fmt: skip
RETRIES = 4  # attempts on other replicas for a request that had not started
STATS_PERIOD_S = 1.0  # how often Ray Serve polls each replica's engine stats
_NOT_SUMMED = ("kv_usage", "spec")  # EngineStats fields a cluster's sum leaves out
_QUEUED = "queued"  # a replica's first item: its engine has taken the request


def ray_modules() -> tuple[Any, Any]:
    """``ray`` and ``ray.serve``, or the one line that says how to get them."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ClusterUnavailable(
            f"--replicas needs Ray Serve, which is not installed ({e}); "
            "install it with: pip install 'dynalm[cluster]'"
        ) from None
    return ray, serve


def connect(address: str | None, num_cpus: int) -> None:
    """Join the Ray cluster at ``address``, or start a local one (127.0.0.1 only, no
    dashboard, ``num_cpus`` CPUs, a small object store). Joining waits at most
    `JOIN_TIMEOUT_S`: Ray's own ``ray.init`` retries forever where a port answers but no
    Ray cluster is behind it."""
    ray, _ = ray_modules()
    if address is not None:
        _reachable(address)
    env = {k: os.environ[k] for k in ENV if k in os.environ}
    try:
        if address is None:
            ray.init(
                address="local",  # a new one, even where `ray start` left an address behind
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
                _node_ip_address="127.0.0.1",
                runtime_env={"env_vars": env},
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            _bounded(
                lambda: ray.init(
                    address=address,
                    runtime_env={"env_vars": env},
                    log_to_driver=False,
                    logging_level=logging.ERROR,  # not its notes on stderr, its errors
                ),
                JOIN_TIMEOUT_S,
                f"the Ray cluster at {address} did not answer within {JOIN_TIMEOUT_S:g} s: "
                "is it a Ray head's address (GCS, port 6379, or ray:// and the client "
                "server's port, 10001)?",
            )
    except ClusterUnavailable:
        raise
    except Exception as e:  # Ray's are ConnectionError, RuntimeError, ValueError...
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterUnavailable(f"could not start or join {where}: {first}") from None


def _bounded(call: Callable[[], object], timeout_s: float, late: str) -> None:
    """``call()`` in a thread of its own, waited for at most ``timeout_s``: its exception
    raised here, or `ClusterUnavailable` (``late``) if it has not returned by then. (The
    thread is a daemon, left behind: what it waits on cannot be cancelled, and the process
    ends soon after an error like this.)"""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # handed over to the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="dynalm-ray-join", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise ClusterUnavailable(late)
    if outcome[0] is not None:
        raise outcome[0]


def _reachable(address: str) -> None:
    """Fail at once on an address nothing listens at (Ray's client retries for ~45 s)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and the like: Ray's own lookup
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterUnavailable(
            f"no Ray cluster answers at {address} ({e.strerror or e}); start one with "
            "`ray start --head`, or leave out --ray-address for a local one"
        ) from None


def shutdown() -> None:
    ray, serve = ray_modules()
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- the replica


class Replica:
    """One engine (the Ray Serve deployment's class): `prepare(name).load()` as `serve`
    loads a model, started at once."""

    def __init__(self, prepare: Callable[[str], Any], name: str) -> None:
        self.service: ModelService = prepare(name).load()
        self.service.start()

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, options: dict
    ) -> AsyncIterator[Any]:
        """``_QUEUED`` once the engine has taken the request, then its outputs."""
        engine = self.service.async_engine
        assert engine is not None
        if (grammar := options.get("grammar")) is not None:  # structured output: see RemoteEngine
            compile_ = self.service.engine.grammars.compile
            options = {k: v for k, v in options.items() if k != "grammar"}
            options["guide"] = await asyncio.to_thread(compile_, *grammar)
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                stream = engine.generate(
                    request_id, prompt, params, queued=lambda: queue.put_nowait(_QUEUED), **options
                )
                async for out in stream:
                    queue.put_nowait(out)
                queue.put_nowait(None)
            except Exception as e:
                queue.put_nowait(e)

        task = asyncio.create_task(pump())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()  # the caller went away: its engine request is aborted

    def record_routing_stats(self) -> dict[str, float]:
        """Its engine's stats (but speculative decoding's), which Ray Serve's controller
        polls and hands the router: the ingress's ``/metrics`` rows for this replica."""
        stats = self.service.engine.stats
        fields = [f.name for f in dataclasses.fields(stats) if f.name != "spec"]
        return {name: getattr(stats, name) for name in fields}

    def shutdown(self) -> None:  # Ray Serve calls it when it stops the replica
        self.service.shutdown()


# ---------------------------------------------------------------- the ingress


def _lost(e: BaseException) -> bool:
    """Whether ``e`` says the replica (its actor) is gone rather than the request failed."""
    rx = ray_modules()[0].exceptions
    return isinstance(e, rx.RayActorError | rx.ActorUnavailableError) and not isinstance(
        e, rx.RayTaskError
    )


class RemoteEngine:
    """The ingress's stand-in for an engine: what `ModelService` and the endpoints read of
    one (config, grammars, stats) and `generate`, answered by the replicas."""

    def __init__(self, model: LoadedModel, config: EngineConfig, handle: Any) -> None:
        self.model = model
        self.config = config
        self.planner = None
        self.grammars = GrammarCompiler(
            model.tokenizer, model.stop_token_ids, model.hparams.n_vocab
        )
        self.device = dataclasses.make_dataclass("Device", [("name", str)])("ray")
        self.memory_plan = dataclasses.make_dataclass("Plan", [("device_bytes", int)])(0)
        self.handle = handle
        self._streams: dict[str, Any] = {}  # request id -> its replica's stream, in flight
        self._aborted: set[str] = set()
        self._accepting = True

    @property
    def stats(self) -> EngineStats:
        """The replicas' engines together, as each last reported them (within about two
        ``STATS_PERIOD_S``): counts summed, KV usage over all their pages."""
        stats = routing.STATS.get(APP)
        rows = [EngineStats(**row, spec=SpecStats())
                for row in (stats.replicas.values() if stats else ()) if row]  # fmt: skip
        counts = [f.name for f in dataclasses.fields(EngineStats) if f.name not in _NOT_SUMMED]
        total = {name: sum(getattr(r, name) for r in rows) for name in counts}
        held = sum(r.kv_usage * r.num_pages for r in rows)
        kv_usage = held / total["num_pages"] if total["num_pages"] else 0.0
        return EngineStats(**total, kv_usage=kv_usage, spec=SpecStats())

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    def abort_all(self) -> None:
        """Stop admitting and abort every request: each ends with finish_reason "abort"
        (its replica's stream cancelled, which aborts it in that engine)."""
        self._accepting = False
        self._aborted.update(self._streams)
        for stream in list(self._streams.values()):
            stream.cancel()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        queued: Callable[[], None] | None = None,
        **kw: object,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncEngine.generate` on a replica the router picks; a replica lost before the
        request's first output: the next one; after: `ReplicaLost`. Closing it (the client
        went away) cancels the replica's stream, which aborts the request there."""
        if not self._accepting:
            raise QueueFull("the server is shutting down")
        if request_id in self._streams:
            raise InvalidRequest(f"request id '{request_id}' is already in use")
        if (guide := kw.pop("guide", None)) is not None:
            # llguidance's matcher is no plain data: its grammar's source crosses (checked
            # here already, so a bad one is the ingress's 400) and the replica compiles it
            assert isinstance(guide, Guide)
            kw["grammar"] = (guide.grammar, guide.what)
        told = False
        last: RequestOutput | None = None
        for attempt in range(RETRIES):
            stream = self.handle.options(stream=True).generate.remote(
                request_id, prompt_ids, params, kw
            )
            self._streams[request_id] = stream
            try:
                async for item in stream:
                    if isinstance(item, str):  # _QUEUED
                        if not told and queued is not None:
                            queued()
                        told = True
                        continue
                    last = item
                    yield item
                return
            except Exception as e:
                if request_id in self._aborted:  # abort_all cancelled it
                    yield _aborted(request_id, prompt_ids, last)
                    return
                if not _lost(e):
                    raise _cause(e) from None
                if last is not None:
                    raise ReplicaLost(
                        f"the replica running this request died after {attempt + 1} "
                        f"attempt(s) ({type(e).__name__}); retry the request"
                    ) from None
                if attempt == RETRIES - 1:
                    raise ReplicaLost(
                        f"no replica could run this request: {RETRIES} died in turn"
                    ) from None
                await asyncio.sleep(0.5 * (attempt + 1))  # Serve drops the dead one meanwhile
            finally:
                if last is None or not last.finished:  # closed early: the replica stops too
                    stream.cancel()
                self._streams.pop(request_id, None)
                self._aborted.discard(request_id)


def _aborted(request_id: str, prompt: list[int], last: RequestOutput | None) -> RequestOutput:
    """The output that ends an aborted request, as an engine's abort gives it."""
    done = (last.prompt_tokens, last.cached_tokens, last.completion_tokens) if last else (
        len(prompt), 0, 0)  # fmt: skip
    return RequestOutput(request_id, "", [], True, "abort", *done)


def _cause(e: Exception) -> Exception:
    """A replica's own exception (QueueFull, PromptTooLong...) as the server maps them."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


class ClusterModelService(ModelService):
    """A model whose engines are the cluster's replicas."""

    def __init__(
        self, model: LoadedModel, config: EngineConfig, names: Sequence[str], handle: Any
    ) -> None:
        super().__init__(RemoteEngine(model, config, handle), model, names)  # type: ignore[arg-type]
        # /metrics: the replicas' engines and the router, not the ingress's stand-in
        self.metrics.registry.unregister(self.metrics.engine_collector)
        self.metrics.registry.register(_ClusterCollector(self.names[0]))

    def start(self) -> None:
        self.async_engine = self.engine  # type: ignore[assignment]

    def shutdown(self, drain: bool = False) -> None:
        pass  # the replicas are Ray Serve's: `shutdown` of this module stops them


class _ClusterCollector(Collector):
    """The replicas' engine metrics (as each last reported them, within
    ``STATS_PERIOD_S``), told apart by a ``replica`` label, and the router's own."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = routing.STATS.get(APP)
        if stats is None:  # no request yet: Ray builds the router on the first
            return
        name = self.model_name
        samples = [([name, replica], EngineStats(**row, spec=SpecStats()))
                   for replica, row in sorted(stats.replicas.items()) if row]  # fmt: skip
        yield from engine_metrics(["model_name", "replica"], samples, spec=False)
        routed = CounterMetricFamily(
            "dynalm:router_requests", "Requests routed to each replica.",
            labels=["model_name", "replica", "policy"],
        )  # fmt: skip
        for replica, n in sorted(stats.routed.items()):
            routed.add_metric([name, replica, stats.policy], n)
        yield routed
        tree = GaugeMetricFamily(
            "dynalm:router_tree_tokens", "Prompt tokens the router believes each replica holds.",
            labels=["model_name", "replica"],
        )  # fmt: skip
        for replica, n in sorted(stats.tree_tokens.items()):
            tree.add_metric([name, replica], n)
        yield tree
        for metric, doc, value in (
            ("router_prompt_tokens", "Prompt tokens routed.", stats.prompt_tokens),
            ("router_prefix_match_tokens", "Of those, tokens the router believed cached on "
             "the replica it chose (a prefix it had sent there).", stats.matched_tokens),
            ("router_load_fallbacks", "Requests the prefix router sent to the least loaded "
             "replica, the loads being imbalanced.", stats.load_fallbacks),
            ("router_hot_spreads", "Requests the prefix router sent to one more replica "
             "for a prefix with more than its holders' share of the traffic.",
             stats.hot_spreads),
        ):  # fmt: skip
            family = CounterMetricFamily(f"dynalm:{metric}", doc, labels=["model_name", "policy"])
            family.add_metric([name, stats.policy], value)
            yield family


def deploy(
    prepare: Callable[[str], Any],
    name: str,
    replicas: int,
    cpus: int,
    router: str = "prefix",
    tree_tokens: int = 1 << 20,
) -> Any:
    """The model's replicas on the cluster (each ``cpus`` CPUs), requests routed by
    ``router`` (a `routing.POLICIES` key; the prefix router's tree holds at most
    ``tree_tokens`` per replica, about what its KV cache holds); their handle."""
    _, serve = ray_modules()
    if router not in POLICIES:
        raise InvalidRequest(f"no router {router!r}: one of {', '.join(POLICIES)}")
    router_config = {  # Ray Serve's RequestRouterConfig
        "request_router_class": f"dynalm.runtime.serve.cluster_routers.{POLICIES[router]}",
        "request_router_kwargs": {"max_tokens": tree_tokens},
        "request_routing_stats_period_s": STATS_PERIOD_S,
    }
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        Replica,
        name="replica",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=1000,  # the engine queues (and refuses past --max-queue)
        health_check_period_s=2,
        health_check_timeout_s=30,
        request_router_config=router_config,
    )
    return serve.run(deployment.bind(prepare, name), name=APP, route_prefix=None)
