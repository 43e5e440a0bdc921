"""`serve --replicas --router`: Ray Serve `RequestRouter`s (its alpha API, Ray 2.60) over
`routing`'s policies. Imported by Ray, by path, in the process holding the deployment's
handle (the ingress), so a router's counters are that process's (`routing.STATS`).

A request's arguments are `Replica.generate`'s: ``(request_id, prompt_ids, params,
options)``; the prefix router reads the prompt's token ids. Load is the router's own count
of requests in flight per replica (routed, not yet completed): exact for the one ingress,
and fresh, where the replicas' reported stats are seconds old.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from dynalm.errors import ClusterUnavailable

try:  # imported by Ray itself, by path: only where Ray is
    from ray.serve._private.replica_result import ReplicaResult
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as e:
    raise ClusterUnavailable(f"the cluster's routers need Ray Serve ({e})") from None

from dynalm.runtime.serve.routing import (
    IMBALANCE,
    MIN_MATCH,
    PrefixTree,
    RouterStats,
    choose_prefix,
)


def _name(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class _Counting(RequestRouter):
    """Counts each replica's requests in flight, what was routed where, and how much of
    each prompt the replica it went to was sent before (the tree: every policy keeps it,
    so their hit rates compare); keeps the replicas' reported engine stats."""

    policy = ""

    def initialize_state(self, max_tokens: int = 1 << 20) -> None:
        # Ray may have pickled this class by value: its module globals would be copies, so
        # the registry is looked up in the process's own module
        from dynalm.runtime.serve import routing

        self.in_flight: dict[ReplicaID, set[str]] = {}
        self.tree = PrefixTree(max_tokens)
        self.stats = RouterStats(self.policy)
        routing.STATS[self._deployment_id.app_name] = self.stats

    def loads(self, candidates: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        return {r.replica_id: len(self.in_flight.get(r.replica_id, ())) for r in candidates}

    def by_load(self, candidates: Sequence[RunningReplica]) -> list[list[RunningReplica]]:
        loads = self.loads(candidates)
        return [[r] for r in sorted(candidates, key=lambda r: loads[r.replica_id])]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.in_flight.setdefault(replica_id, set()).add(
            pending_request.metadata.internal_request_id
        )
        self.stats.routed[_name(replica_id)] += 1
        if len(pending_request.args) >= 2:
            tokens = pending_request.args[1]
            self.stats.prompt_tokens += len(tokens)
            self.stats.matched_tokens += self.tree.match(tokens, [replica_id])[0]
            self.tree.insert(tokens, replica_id)
            self.stats.tree_tokens[_name(replica_id)] = self.tree.sizes[replica_id]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id, set()).discard(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Ray Serve's controller polls `Replica.record_routing_stats` and broadcasts them
        self.stats.replicas = {_name(r.replica_id): dict(r.routing_stats) for r in replicas}
        for gone in self.tree.tenants() - self._replica_id_set:
            self.forget(gone)  # a restarted replica's cache starts empty

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        self.stats.replicas.pop(_name(replica_id), None)
        self.forget(replica_id)

    def forget(self, replica_id: ReplicaID) -> None:
        self.tree.remove(replica_id)
        self.stats.tree_tokens.pop(_name(replica_id), None)


class PrefixRouter(_Counting):
    """The replica holding the longest prefix of the prompt, unless loads are imbalanced
    (`routing.choose_prefix`)."""

    policy = "prefix"

    def initialize_state(  # type: ignore[override]
        self, max_tokens: int = 1 << 20, imbalance: int = IMBALANCE, min_match: float = MIN_MATCH
    ) -> None:
        super().initialize_state(max_tokens)
        self.imbalance = imbalance
        self.min_match = min_match

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or len(pending_request.args) < 2:
            return self.by_load(candidate_replicas)
        order, _, by_load = choose_prefix(
            self.tree,
            pending_request.args[1],
            self.loads(candidate_replicas),
            self.imbalance,
            self.min_match,
        )
        self.stats.load_fallbacks += by_load
        by_id = {r.replica_id: r for r in candidate_replicas}
        # one rank each: Ray tries the first, the next only if it refuses the request
        return [[by_id[i]] for i in order]


class RoundRobinRouter(_Counting):
    """Each replica in turn (for comparison)."""

    policy = "round-robin"

    def initialize_state(self, max_tokens: int = 1 << 20) -> None:
        super().initialize_state(max_tokens)
        self.turn = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ring = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ring:
            return []
        k = next(self.turn) % len(ring)
        return [[r] for r in ring[k:] + ring[:k]]


class Pow2Router(_Counting):
    """Power of two choices on requests in flight (for comparison)."""

    policy = "pow2"

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return self.by_load(random.sample(candidate_replicas, min(2, len(candidate_replicas))))
