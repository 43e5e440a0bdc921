"""How `serve --replicas` picks a replica for a request: the policies, without Ray.

`PrefixTree` is an approximate radix tree of the token prefixes each replica has been sent
(SGLang's cache-aware router and Ray's PrefixCacheAffinityRouter keep the same, over
characters): approximate because a replica's prefix cache evicts on its own and the tree
cannot see it, and because each replica's share of the tree is capped (least recently
used branches dropped first) at about what its KV cache holds; it also counts the recent
requests through each prefix. `choose_prefix` is the policy over it: the longest match;
one more replica for a prefix with more than its holders' fair share of the traffic (a
hot one); the least loaded instead if the replica chosen has more requests in flight
than the least loaded one by more than ``IMBALANCE``; the smallest share of the tree when
nothing matches well. `choose_pow2` and
`choose_round_robin` are the policies to compare it with. `Router` is the state a router
keeps (requests in flight, the tree, its counters) and its choice, replicas being any
hashable keys: the Ray Serve routers and `benchmarks/cluster_sim.py`'s simulated
replicas run the same one.
`RouterStats` counts what the policy did, for ``/metrics``. The Ray Serve
`RequestRouter`s that apply a `Router` are in `cluster_routers` (which needs Ray);
`POLICIES` names them for ``--router``.

A wrong tree costs time, never correctness: a replica sent a prefix it has evicted
prefills it again (and the tree, refreshed by that request, is right again).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

POLICIES = {"prefix": "PrefixRouter", "pow2": "Pow2Router", "round-robin": "RoundRobinRouter"}
IMBALANCE = 4  # requests in flight, the target's minus the least loaded's, past which load wins
MIN_MATCH = 0.1  # a match shorter than this fraction of the prompt is no match
WINDOW = 256  # requests: the horizon of a prefix's recent share of the traffic (decayed)
HOT = 1.0  # a prefix past this multiple of its holders' fair share of requests is hot
CONFIDENCE = 2.0  # z of the lower bound (Wilson's) a hot prefix's share must clear


class _Node:
    __slots__ = ("children", "heat", "heat_tick", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key  # the edge's tokens, from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first token of their key
        self.tenants: dict[Hashable, int] = {}  # replica -> tick it last used this node
        self.heat = 0.0  # requests that went through this node, decayed: as of heat_tick
        self.heat_tick = 0


class PrefixTree:
    """The token prefixes each replica (a "tenant") was sent, sharing common prefixes.

    A tenant on a node is on all its ancestors too. Each tenant holds at most
    ``max_tokens`` tokens of the tree; an insert past that evicts its least recently used
    leaves. Each node also counts the inserts through it (whichever tenant), decayed by
    ``1 - 1/window`` an insert: its share of the recent traffic (`traffic`)."""

    def __init__(self, max_tokens: int = 1 << 20, window: int = WINDOW) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, not {max_tokens}")
        if window < 1:
            raise ValueError(f"window must be positive, not {window}")
        self.max_tokens = max_tokens
        self._decay = 1.0 - 1.0 / window
        self.root = _Node((), None)
        self.sizes: Counter[Hashable] = Counter()  # tokens each tenant holds
        self._tick = itertools.count(1)
        self._lock = threading.Lock()  # Ray's router calls from its loop, tests from theirs

    def insert(self, tokens: Sequence[int], tenant: Hashable) -> None:
        with self._lock:
            tick = next(self._tick)
            node, i = self.root, 0
            node.tenants[tenant] = tick
            self._warm(node, tick)
            while i < len(tokens):
                child = node.children.get(tokens[i])
                if child is None:
                    child = _Node(tuple(tokens[i:]), node)
                    node.children[tokens[i]] = child
                n = _common(child.key, tokens, i)
                if n < len(child.key):
                    child = self._split(child, n)
                if tenant not in child.tenants:
                    self.sizes[tenant] += len(child.key)
                child.tenants[tenant] = tick
                self._warm(child, tick)
                node, i = child, i + n
            if self.sizes[tenant] > self.max_tokens:
                self._evict(tenant, self.max_tokens)

    def match(
        self, tokens: Sequence[int], tenants: Sequence[Hashable]
    ) -> tuple[int, list[Hashable]]:
        """The longest prefix of ``tokens`` any of ``tenants`` holds, and which hold it."""
        with self._lock:
            node, i = self.root, 0
            alive = [t for t in tenants if t in node.tenants]
            while i < len(tokens) and alive:
                child = node.children.get(tokens[i])
                have = [t for t in alive if child is not None and t in child.tenants]
                if not have:
                    break
                assert child is not None
                n = _common(child.key, tokens, i)
                node, i, alive = child, i + n, have
                if n < len(child.key):
                    break
            return (i, alive) if i else (0, [])

    def traffic(
        self, tokens: Sequence[int], tenants: Sequence[Hashable], min_depth: int
    ) -> tuple[float, list[tuple[int, float, list[Hashable]]]]:
        """How much of the recent traffic went through each prefix of ``tokens`` the tree
        has a node for: the recent requests in all (decayed counts), and for each node on
        the path whose edge ``tokens`` cover whole and that ends ``min_depth`` tokens or
        more in, ``(depth, recent requests through it, which of tenants hold it)``."""
        with self._lock:
            now = self._now()
            node, i, out = self.root, 0, []
            while i < len(tokens):
                child = node.children.get(tokens[i])
                if child is None or _common(child.key, tokens, i) < len(child.key):
                    break
                node, i = child, i + len(child.key)
                if i >= min_depth:
                    holders = [t for t in tenants if t in node.tenants]
                    out.append((i, self._heat(node, now), holders))
            return self._heat(self.root, now), out

    def last_sent(self, tenant: Hashable) -> int:
        """The tick of the tenant's latest insert (0: never): older first breaks ties."""
        return self.root.tenants.get(tenant, 0)

    def remove(self, tenant: Hashable) -> None:
        """Forget a replica (it died: its successor's cache starts empty)."""
        with self._lock:
            self._evict(tenant, 0)
            self.root.tenants.pop(tenant, None)
            self.sizes.pop(tenant, None)

    def tenants(self) -> set[Hashable]:
        return set(self.root.tenants)

    def _now(self) -> int:
        """The tick of the latest insert."""
        return self.root.heat_tick

    def _heat(self, node: _Node, now: int) -> float:
        return node.heat * self._decay ** (now - node.heat_tick)

    def _warm(self, node: _Node, tick: int) -> None:
        node.heat, node.heat_tick = self._heat(node, tick) + 1.0, tick

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` tokens; the new upper node (same tenants, same
        traffic: every insert through the lower went through it)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:n], parent)
        upper.tenants = dict(node.tenants)
        upper.heat, upper.heat_tick = node.heat, node.heat_tick
        parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[n:], upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, tenant: Hashable, keep: int) -> None:
        """Drop ``tenant``'s least recently used leaves until it holds ``keep`` tokens."""
        leaves = [n for n in self._nodes(tenant) if self._leaf_of(n, tenant)]
        leaves.sort(key=lambda n: n.tenants[tenant])
        while leaves and self.sizes[tenant] > keep:
            leaf = leaves.pop(0)
            del leaf.tenants[tenant]
            self.sizes[tenant] -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            if not leaf.tenants:
                del parent.children[leaf.key[0]]
            if parent is not self.root and self._leaf_of(parent, tenant):
                # the parent is the tenant's leaf now (as recent as its child was)
                leaves.append(parent)
                leaves.sort(key=lambda n: n.tenants[tenant])

    @staticmethod
    def _leaf_of(node: _Node, tenant: Hashable) -> bool:
        return not any(tenant in c.tenants for c in node.children.values())

    def _nodes(self, tenant: Hashable) -> list[_Node]:
        out, todo = [], [c for c in self.root.children.values() if tenant in c.tenants]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(c for c in node.children.values() if tenant in c.tenants)
        return out


def _common(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    n = 0
    limit = min(len(key), len(tokens) - start)
    while n < limit and key[n] == tokens[start + n]:
        n += 1
    return n


@dataclass
class RouterStats:
    """What a router did: for ``/metrics`` (``dynalm:router_*``)."""

    policy: str
    routed: Counter[str] = field(default_factory=Counter)  # replica -> requests
    prompt_tokens: int = 0
    matched_tokens: int = 0  # of prompt_tokens, on the chosen replica's branch of the tree
    load_fallbacks: int = 0  # prefix: sent to the least loaded, the loads being imbalanced
    hot_spreads: int = 0  # prefix: sent to a new holder of a hot prefix
    replicas: dict[str, dict] = field(default_factory=dict)  # each one's EngineStats, reported
    tree_tokens: dict[str, int] = field(default_factory=dict)  # each one's share of the tree


STATS: dict[str, RouterStats] = {}  # this process's routers' (a Ray Serve app's), by app


def choose_prefix(
    tree: PrefixTree,
    tokens: Sequence[int],
    loads: Mapping[Hashable, int],
    imbalance: int = IMBALANCE,
    min_match: float = MIN_MATCH,
    hot: float = HOT,
) -> tuple[list[Hashable], int, bool, bool]:
    """The replicas in order of preference for a prompt, given each one's requests in
    flight; with the tokens the first one is believed to hold, whether load decided and
    whether a hot prefix was spread.

    The target: the replica with the longest match, if it covers ``min_match`` of the
    prompt; of several holding it, the least loaded, then the one sent a request longest
    ago (so a prefix held twice alternates even when loads tie at 0). Otherwise (a new
    prefix) the one holding the least of the tree, least loaded first among equals, so
    prefixes spread over the replicas' caches (SGLang's "smallest tenant"): a difference of
    a request or two in flight is noise at this point, where the cache a prefix lands in
    is not.

    A hot prefix gets one more holder: if a matched prefix's share of the recent requests
    exceeds ``hot`` x its holders' fair share (holders / replicas), `CONFIDENCE` standard
    errors sure (a lower bound: a prefix seen once proves nothing), the request goes to
    the least loaded replica not holding it (one prefill there; then "least loaded among
    holders" splits its traffic). Without that,
    a prompt with 80 % of the traffic keeps 80 % of the requests on one replica whenever
    it is not busy enough for the load test.

    If the target has more than ``imbalance`` requests in flight beyond the least loaded
    replica's, the least loaded instead. (The target's load, not the spread of all the
    loads: one busy replica among 64 must not turn every other request's routing into
    least-loaded.)"""
    if not loads:
        return [], 0, False, False
    by_load = sorted(loads, key=lambda t: (loads[t], tree.sizes.get(t, 0), str(t)))
    least, spread = loads[by_load[0]], False
    n, holders = tree.match(tokens, list(loads))
    if n and n >= min_match * len(tokens):
        order = sorted(holders, key=lambda t: (loads[t], tree.last_sent(t), str(t)))
        spare = _spare(tree, tokens, by_load, min_match, hot)
        if spare is not None:
            order, n, spread = [spare, *order], tree.match(tokens, [spare])[0], True
        order += [t for t in by_load if t not in set(order)]
    else:
        n, order = 0, sorted(loads, key=lambda t: (tree.sizes.get(t, 0), loads[t], str(t)))
    if loads[order[0]] - least > imbalance:
        return by_load, tree.match(tokens, by_load[:1])[0], True, False
    return order, n, False, spread


def _spare(
    tree: PrefixTree, tokens: Sequence[int], by_load: list[Hashable], min_match: float, hot: float
) -> Hashable | None:
    """The least loaded replica not holding a hot prefix of ``tokens`` (`choose_prefix`),
    or None: no prefix of ``min_match`` of the prompt or more is hot."""
    total, path = tree.traffic(tokens, by_load, math.ceil(min_match * len(tokens)))
    for _, requests, holders in path:  # shallowest first: the widest-shared prefix
        if holders and _lower_bound(requests / total, total) > hot * len(holders) / len(by_load):
            return next(t for t in by_load if t not in set(holders))
    return None


def _lower_bound(share: float, n: float, z: float = CONFIDENCE) -> float:
    """Wilson's lower bound on a share measured as ``share`` of ``n`` samples: small
    samples (a prefix seen once: 1 of 1) prove little, as they should."""
    centre = share + z * z / (2 * n)
    spread = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


def choose_pow2(loads: Mapping[Hashable, int], rng: random.Random) -> list[Hashable]:
    """Two replicas at random, the less loaded first (power of two choices)."""
    two = rng.sample(list(loads), min(2, len(loads)))
    return sorted(two, key=lambda t: loads[t])


def choose_round_robin(ring: Sequence[Hashable], turn: int) -> list[Hashable]:
    """The ring, starting at the ``turn``-th replica (modulo its length)."""
    if not ring:
        return []
    k = turn % len(ring)
    return [*ring[k:], *ring[:k]]


class Router:
    """One router's state, without Ray: each replica's requests in flight (routed, not
    completed), the tree of the prefixes each was sent (every policy keeps it, so their
    hit rates compare), its counters; and its choice for a request. ``name`` turns a
    replica's key into the label ``/metrics`` shows."""

    def __init__(
        self,
        policy: str,
        max_tokens: int = 1 << 20,
        imbalance: int = IMBALANCE,
        min_match: float = MIN_MATCH,
        name: Callable[[Hashable], str] = str,
        rng: random.Random | None = None,
        hot: float = HOT,
        window: int = WINDOW,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy, self.imbalance, self.min_match, self.name, self.hot = (
            policy, imbalance, min_match, name, hot
        )  # fmt: skip
        self.in_flight: dict[Hashable, set[str]] = {}
        self.tree = PrefixTree(max_tokens, window)
        self.stats = RouterStats(policy)
        self.rng = rng or random.Random()
        self.turn = itertools.count()

    def loads(self, replicas: Sequence[Hashable]) -> dict[Hashable, int]:
        return {r: len(self.in_flight.get(r, ())) for r in replicas}

    def by_load(self, replicas: Sequence[Hashable]) -> list[Hashable]:
        loads = self.loads(replicas)
        return sorted(replicas, key=lambda r: loads[r])

    def choose(self, replicas: Sequence[Hashable], tokens: Sequence[int] | None) -> list[Hashable]:
        """The replicas to try for a request, in order (``tokens``: its prompt, if known)."""
        if self.policy == "round-robin":
            return choose_round_robin(sorted(replicas, key=self.name), next(self.turn))
        if self.policy == "pow2":
            return choose_pow2(self.loads(replicas), self.rng)
        if tokens is None:
            return self.by_load(replicas)
        order, _, by_load, spread = choose_prefix(
            self.tree, tokens, self.loads(replicas), self.imbalance, self.min_match, self.hot
        )
        self.stats.load_fallbacks += by_load
        self.stats.hot_spreads += spread
        return order

    def routed(self, replica: Hashable, request_id: str, tokens: Sequence[int] | None) -> None:
        self.in_flight.setdefault(replica, set()).add(request_id)
        self.stats.routed[self.name(replica)] += 1
        if tokens is not None:
            self.stats.prompt_tokens += len(tokens)
            self.stats.matched_tokens += self.tree.match(tokens, [replica])[0]
            self.tree.insert(tokens, replica)
            self.stats.tree_tokens[self.name(replica)] = self.tree.sizes[replica]

    def completed(self, replica: Hashable, request_id: str) -> None:
        self.in_flight.get(replica, set()).discard(request_id)

    def forget(self, replica: Hashable) -> None:
        """A replica died or was replaced: its successor's cache starts empty."""
        self.in_flight.pop(replica, None)
        self.tree.remove(replica)
        self.stats.tree_tokens.pop(self.name(replica), None)
        self.stats.replicas.pop(self.name(replica), None)
