"""How `serve --replicas` picks a replica for a request: the policies, without Ray.

`PrefixTree` is an approximate radix tree of the token prefixes each replica has been sent
(SGLang's cache-aware router and Ray's PrefixCacheAffinityRouter keep the same, over
characters): approximate because a replica's prefix cache evicts on its own and the tree
cannot see it, and because each replica's share of the tree is capped (least recently
used branches dropped first) at about what its KV cache holds. `choose_prefix` is the
policy over it: the longest match when the replicas' loads are balanced, the least
loaded when they are not, the smallest share of the tree when nothing matches well.
`RouterStats` counts what the policy did, for ``/metrics``. The Ray Serve
`RequestRouter`s that apply them are in `cluster_routers` (which needs Ray); `POLICIES`
names them for ``--router``.

A wrong tree costs time, never correctness: a replica sent a prefix it has evicted
prefills it again (and the tree, refreshed by that request, is right again).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

POLICIES = {"prefix": "PrefixRouter", "pow2": "Pow2Router", "round-robin": "RoundRobinRouter"}
IMBALANCE = 4  # requests in flight, most loaded minus least loaded, past which load wins
MIN_MATCH = 0.1  # a match shorter than this fraction of the prompt is no match


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key  # the edge's tokens, from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first token of their key
        self.tenants: dict[Hashable, int] = {}  # replica -> tick it last used this node


class PrefixTree:
    """The token prefixes each replica (a "tenant") was sent, sharing common prefixes.

    A tenant on a node is on all its ancestors too. Each tenant holds at most
    ``max_tokens`` tokens of the tree; an insert past that evicts its least recently used
    leaves."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, not {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Node((), None)
        self.sizes: Counter[Hashable] = Counter()  # tokens each tenant holds
        self._tick = itertools.count(1)
        self._lock = threading.Lock()  # Ray's router calls from its loop, tests from theirs

    def insert(self, tokens: Sequence[int], tenant: Hashable) -> None:
        with self._lock:
            tick = next(self._tick)
            node, i = self.root, 0
            node.tenants[tenant] = tick
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

    def remove(self, tenant: Hashable) -> None:
        """Forget a replica (it died: its successor's cache starts empty)."""
        with self._lock:
            self._evict(tenant, 0)
            self.root.tenants.pop(tenant, None)
            self.sizes.pop(tenant, None)

    def tenants(self) -> set[Hashable]:
        return set(self.root.tenants)

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` tokens; the new upper node (same tenants)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:n], parent)
        upper.tenants = dict(node.tenants)
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
    replicas: dict[str, dict] = field(default_factory=dict)  # each one's EngineStats, reported
    tree_tokens: dict[str, int] = field(default_factory=dict)  # each one's share of the tree


STATS: dict[str, RouterStats] = {}  # this process's routers' (a Ray Serve app's), by app


def choose_prefix(
    tree: PrefixTree,
    tokens: Sequence[int],
    loads: Mapping[Hashable, int],
    imbalance: int = IMBALANCE,
    min_match: float = MIN_MATCH,
) -> tuple[list[Hashable], int, bool]:
    """The replicas in order of preference for a prompt, given each one's requests in
    flight; with the tokens the first one is believed to hold and whether load decided.

    Balanced loads (most minus least ≤ ``imbalance``): the replicas with the longest
    match, least loaded first, if it covers ``min_match`` of the prompt; otherwise (a new
    prefix) the one holding the least of the tree, least loaded first among equals, so
    prefixes spread over the replicas' caches (SGLang's "smallest tenant"): a
    difference of a request or two in flight is noise at this point, where the cache a
    prefix lands in is not. Imbalanced: the least loaded."""
    if not loads:
        return [], 0, False
    by_load = sorted(loads, key=lambda t: (loads[t], tree.sizes.get(t, 0), str(t)))
    if max(loads.values()) - min(loads.values()) > imbalance:
        return by_load, tree.match(tokens, by_load[:1])[0], True
    n, holders = tree.match(tokens, list(loads))
    if n and n >= min_match * len(tokens):
        best = sorted(holders, key=by_load.index)
        return best + [t for t in by_load if t not in best], n, False
    by_size = sorted(loads, key=lambda t: (tree.sizes.get(t, 0), loads[t], str(t)))
    return by_size, 0, False
