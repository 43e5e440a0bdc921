"""`serve --replicas --router`: Ray Serve `RequestRouter`s (its alpha API, Ray 2.60) over
`routing`'s policies. Imported by Ray, by path, in the process holding the deployment's
handle (the ingress), so a router's counters are that process's (`routing.STATS`).

A request's arguments are `Replica.generate`'s: ``(request_id, prompt_ids, params,
options)``; the prefix router reads the prompt's token ids. Load is the router's own count
of requests in flight per replica (routed, not yet completed): exact for the one ingress,
and fresh, where the replicas' reported stats are seconds old.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynalm.errors import ClusterUnavailable

try:  # imported by Ray itself, by path: only where Ray is
    from ray.serve._private.replica_result import ReplicaResult
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as e:
    raise ClusterUnavailable(f"the cluster's routers need Ray Serve ({e})") from None

from dynalm.runtime.serve.routing import IMBALANCE, MIN_MATCH, Router


def _name(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class _Counting(RequestRouter):
    """A `routing.Router` under Ray Serve: counts each replica's requests in flight, what
    was routed where, and how much of each prompt the replica it went to was sent before;
    keeps the replicas' reported engine stats. The choice is the `Router`'s."""

    policy = ""

    def initialize_state(
        self, max_tokens: int = 1 << 20, imbalance: int = IMBALANCE, min_match: float = MIN_MATCH
    ) -> None:
        # Ray may have pickled this class by value: its module globals would be copies, so
        # the registry is looked up in the process's own module
        from dynalm.runtime.serve import routing

        self.router = Router(self.policy, max_tokens, imbalance, min_match, name=_name)
        self.stats = self.router.stats
        routing.STATS[self._deployment_id.app_name] = self.stats

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        tokens = _prompt(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        # one rank each: Ray tries the first, the next only if it refuses the request
        return [[by_id[i]] for i in self.router.choose(list(by_id), tokens)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.router.routed(
            replica_id, pending_request.metadata.internal_request_id, _prompt(pending_request)
        )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.router.completed(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Ray Serve's controller polls `Replica.record_routing_stats` and broadcasts them
        self.stats.replicas = {_name(r.replica_id): dict(r.routing_stats) for r in replicas}
        for gone in self.router.tree.tenants() - self._replica_id_set:
            self.router.forget(gone)  # a restarted replica's cache starts empty

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id)


def _prompt(pending_request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt's token ids: `Replica.generate`'s second argument."""
    if pending_request is None or len(pending_request.args) < 2:
        return None
    return pending_request.args[1]


class PrefixRouter(_Counting):
    """The replica holding the longest prefix of the prompt, unless loads are imbalanced
    (`routing.choose_prefix`)."""

    policy = "prefix"


class RoundRobinRouter(_Counting):
    """Each replica in turn (for comparison)."""

    policy = "round-robin"


class Pow2Router(_Counting):
    """Power of two choices on requests in flight (for comparison)."""

    policy = "pow2"
