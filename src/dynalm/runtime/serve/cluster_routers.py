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
from typing import Any

from ray.serve._private.replica_result import ReplicaResult
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

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
    """Counts each replica's requests in flight and what was routed where."""

    policy = ""

    def initialize_state(self, **kwargs: Any) -> None:
        # Ray may have pickled this class by value: its module globals would be copies, so
        # the registry is looked up in the process's own module
        from dynalm.runtime.serve import routing

        self.in_flight: dict[ReplicaID, set[str]] = {}
        self.stats = RouterStats(self.policy)
        routing.STATS[self._deployment_id.app_name] = self.stats

    def loads(self, candidates: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        return {r.replica_id: len(self.in_flight.get(r.replica_id, ())) for r in candidates}

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.in_flight.setdefault(replica_id, set()).add(
            pending_request.metadata.internal_request_id
        )
        self.stats.routed[_name(replica_id)] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)


class PrefixRouter(_Counting):
    """The replica holding the longest prefix of the prompt, unless loads are imbalanced
    (`routing.choose_prefix`)."""

    policy = "prefix"

    def initialize_state(  # type: ignore[override]
        self, max_tokens: int = 1 << 20, imbalance: int = IMBALANCE, min_match: float = MIN_MATCH
    ) -> None:
        super().initialize_state()
        self.tree = PrefixTree(max_tokens)
        self.imbalance = imbalance
        self.min_match = min_match

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or len(pending_request.args) < 2:
            loads = self.loads(candidate_replicas)
            return [[r] for r in sorted(candidate_replicas, key=lambda r: loads[r.replica_id])]
        tokens = pending_request.args[1]
        order, _, by_load = choose_prefix(
            self.tree, tokens, self.loads(candidate_replicas), self.imbalance, self.min_match
        )
        self.stats.load_fallbacks += by_load
        by_id = {r.replica_id: r for r in candidate_replicas}
        # one rank each: Ray tries the first, the next only if it refuses the request
        return [[by_id[i]] for i in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        if len(pending_request.args) >= 2:
            tokens = pending_request.args[1]
            self.stats.prompt_tokens += len(tokens)
            self.stats.matched_tokens += self.tree.match(tokens, [replica_id])[0]
            self.tree.insert(tokens, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in self.tree.tenants() - self._replica_id_set:
            self.tree.remove(gone)  # a restarted replica's cache starts empty

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tree.remove(replica_id)


class RoundRobinRouter(_Counting):
    """Each replica in turn (for comparison)."""

    policy = "round-robin"

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state()
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
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [[r] for r in sorted(two, key=lambda r: len(self.in_flight.get(r.replica_id, ())))]
