"""Radix prefix cache: a tree over token ids whose edges carry KV pages.

Each node holds a run of whole pages (``len(tokens) == len(pages) * page_size``);
children are keyed by the tokens of their first page. Matching is token-exact:
whole pages are matched down the tree (a match ending inside a node splits it at
the page boundary), then the longest common prefix with the next cached page is
returned as a *partial* page, which the sequence shares and copies on its first
write into it (copy-on-write, done by the KV manager).

The tree holds one reference to each of its pages in the ``PagePool``. Sequences
lock the path they use (lock counts walk up to the root), so only unlocked
leaves are evicted, least recently used first, returning their pages to the pool.
With an ``n_layers=0`` pool the tree runs without any KV memory (unit tests).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dynalm.runtime.engine.kv_cache import PagePool


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Node:
    """A run of whole cached pages below ``parent``."""

    __slots__ = ("parent", "children", "tokens", "pages", "lock", "last_used")

    def __init__(self, parent: Node | None, tokens: tuple[int, ...], pages: list[int]):
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.tokens = tokens
        self.pages = pages
        self.lock = 0
        self.last_used = 0


@dataclass
class PrefixMatch:
    """The cached prefix of a prompt: ``pages`` hold its first ``n_tokens`` tokens.

    The last page is partial when ``n_tokens`` is not a multiple of the page size.
    ``node`` is the deepest node of the whole-page match (the one to lock)."""

    pages: list[int]
    n_tokens: int
    node: Node


class RadixCache:
    def __init__(self, pool: PagePool, enabled: bool = True):
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self.root = Node(None, (), [])
        self.root.lock = 1  # never evicted
        self.n_pages = 0  # pages the tree holds
        self.evictable_pages = 0  # of those, pages in unlocked nodes
        self._clock = itertools.count(1)

    def _page_key(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page_size])

    def _common_pages(self, node: Node, tokens: Sequence[int], at: int) -> int:
        """How many of ``node``'s pages equal the whole pages of ``tokens`` from ``at``."""
        ps, n = self.page_size, 0
        while (
            n < len(node.pages)
            and at + (n + 1) * ps <= len(tokens)
            and tuple(tokens[at + n * ps : at + (n + 1) * ps]) == node.tokens[n * ps : (n + 1) * ps]
        ):
            n += 1
        return n

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut ``node`` after ``n_pages`` pages; returns the new upper part."""
        cut = n_pages * self.page_size
        upper = Node(node.parent, node.tokens[:cut], node.pages[:n_pages])
        upper.lock, upper.last_used = node.lock, node.last_used  # every lock through node
        assert node.parent is not None
        node.parent.children[node.tokens[: self.page_size]] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[n_pages:], upper
        upper.children[node.tokens[: self.page_size]] = node
        return upper

    def _walk(self, tokens: Sequence[int]) -> tuple[Node, int]:
        """Follow whole pages of ``tokens`` down the tree, splitting where a match ends
        inside a node; returns the deepest node and the number of tokens matched."""
        node, at, stamp = self.root, 0, next(self._clock)
        while at + self.page_size <= len(tokens):
            child = node.children.get(self._page_key(tokens, at))
            if child is None:
                break
            n = self._common_pages(child, tokens, at)
            inside = n < len(child.pages)
            if inside:
                child = self._split(child, n)
            child.last_used = stamp
            node, at = child, at + n * self.page_size
            if inside:
                break
        return node, at

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` (token-exact). The caller retains the
        pages it keeps and locks ``node``."""
        if not self.enabled:
            return PrefixMatch([], 0, self.root)
        node, at = self._walk(tokens)
        pages = [p for n in self._path(node) for p in n.pages]
        # A partial page: the longest common prefix of the next tokens with a cached page.
        rest, best, best_page = tokens[at : at + self.page_size], 0, -1
        for child in node.children.values():
            n = _common_prefix(rest, child.tokens)
            if n > best:
                best, best_page = n, child.pages[0]
                child.last_used = next(self._clock)
        if best:
            pages.append(best_page)
        return PrefixMatch(pages, at + best, node)

    def _path(self, node: Node) -> list[Node]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Node:
        """Cache whole ``pages`` holding ``tokens`` (``len(tokens) == len(pages) *
        page_size``); pages already cached for the same tokens are kept (the caller's
        duplicates stay the caller's). Returns the node of the last page."""
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages")
        if not self.enabled:
            return self.root
        node, at = self._walk(tokens)
        if at < len(tokens):
            new_pages = list(pages[at // self.page_size :])
            child = Node(node, tuple(tokens[at:]), new_pages)
            child.last_used = next(self._clock)
            node.children[child.tokens[: self.page_size]] = child
            self.pool.retain(new_pages)
            self.n_pages += len(new_pages)
            self.evictable_pages += len(new_pages)
            node = child
        return node

    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock == 0:
                self.evictable_pages -= len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            node.lock -= 1
            if node.lock < 0:
                raise RuntimeError("radix cache node unlocked twice")
            if node.lock == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, n_pages: int) -> int:
        """Drop least recently used unlocked leaves until ``n_pages`` pages went back to
        the pool (or nothing is left to evict); returns the pages freed."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and not n.lock]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < n_pages:
            _, _, node = heapq.heappop(leaves)
            freed += self.pool.release(node.pages)
            self.n_pages -= len(node.pages)
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[: self.page_size]]
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]
