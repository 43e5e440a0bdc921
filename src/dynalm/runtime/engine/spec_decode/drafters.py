"""Drafters for speculative decoding: they propose tokens to follow running sequences.

A drafter is ``propose`` and ``release`` (a new one is one class):
* ``NgramDrafter``: prompt lookup: the last n tokens (n = 3, 2, 1) found earlier in the
  sequence's own prompt and output propose what followed them. No model, no cost.
* ``ModelDrafter``: a smaller model with the target's vocabulary (``for_model``), run by
  the engine's own parts (executor, paged KV pool, KV manager) over sequences that follow
  the target's accepted tokens; ``layer_skip`` makes the target itself, with some layers
  skipped, its draft.

How many tokens each sequence drafts is the planner's (``draft_planner.DraftPlanner``); what is
kept of a draft, the rejection sampler's (``engine.rejection_sampler``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynalm.core.device import Device
from dynalm.errors import InvalidRequest
from dynalm.ir.executor import Executor
from dynalm.ir.graph import Graph
from dynalm.models.hparams import HParams
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.config import EngineConfig, check_num_draft_tokens
from dynalm.runtime.engine.kv_cache import PagePool
from dynalm.runtime.engine.memory_plan import kv_pool_size
from dynalm.runtime.engine.radix_cache import RadixCache
from dynalm.runtime.engine.scheduler import KVCacheManager, Request, ScheduledChunk, flat_batch
from dynalm.runtime.engine.spec_decode.step_cost import StepCost


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None = None  # [len(tokens), V] the drafter drew them from; None: chosen
    kind: int = 0  # what acceptance rate it goes by (``DraftLength``)


class Drafter:
    """Proposes tokens to follow running sequences."""

    name = "drafter"
    cost = 0.0  # a pass's time as a share of a target step of as many tokens (the prior)
    free = False  # proposing costs nothing: every sequence is asked, its draft planned after

    def pass_time(self, n_seqs: int, target: StepCost) -> float:
        """The time of one drafting pass over ``n_seqs`` sequences, in ``target``'s units."""
        return self.cost * target(n_seqs)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ``ks[i]`` tokens to follow ``requests[i].token_ids``, for each request."""
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished: forget it."""


class NgramDrafter(Drafter):
    """Prompt lookup: the sequence's last n tokens (n from ``max_n`` down to 1) looked up in
    its own prompt and output; what followed their latest earlier occurrence is proposed.
    Each sequence keeps an index of its n-grams, extended as it grows."""

    name = "ngram"
    free = True

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._index: dict[str, tuple[list[dict[tuple[int, ...], int]], list[int]]] = {}

    def _lookup(self, rid: str, ids: list[int], k: int) -> Draft:
        maps, done = self._index.setdefault(rid, ([{} for _ in range(self.max_n)], [0]))
        for i in range(max(done[0], 1), len(ids)):  # the n-grams ending before token i
            for n in range(1, min(self.max_n, i) + 1):
                maps[n - 1][tuple(ids[i - n : i])] = i  # the latest occurrence wins
        done[0] = len(ids)
        for n in range(min(self.max_n, len(ids)), 0, -1):
            start = maps[n - 1].get(tuple(ids[-n:]))
            if start is not None:
                return Draft(ids[start : start + k], kind=n)
        return Draft([])

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        return [
            self._lookup(r.request_id, r.token_ids, k) if k else Draft([])
            for r, k in zip(requests, ks, strict=True)
        ]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def check_vocabularies(draft: LoadedModel, target: LoadedModel, tolerance: int = 128) -> None:
    """A draft model must speak the target's tokens: vocabulary sizes within ``tolerance``
    (padding rows) and the same text for every id both have; and it must be smaller."""
    dv, tv = draft.hparams.n_vocab, target.hparams.n_vocab
    where = f"draft model {draft.path.name} for {target.path.name}"
    if abs(dv - tv) > tolerance:
        raise InvalidRequest(f"{where}: vocabularies of {dv} and {tv} tokens differ")
    dt, tt = draft.tokenizer, target.tokenizer
    for i in range(min(dt.vocab_size, tt.vocab_size)):
        if dt.id_to_token(i) != tt.id_to_token(i):
            raise InvalidRequest(
                f"{where}: token {i} is {dt.id_to_token(i)!r} in the draft but "
                f"{tt.id_to_token(i)!r} in the target (the vocabularies differ)"
            )
    if draft.n_params > target.n_params:
        raise InvalidRequest(
            f"{where}: the draft ({draft.n_params / 1e6:.0f} M parameters) is larger than "
            f"the target ({target.n_params / 1e6:.0f} M); a draft must be cheaper to run"
        )


class _RenamedLayers:
    """A model's weights seen by a graph of fewer layers: its ``blk.i`` is ``blk.keep[i]``."""

    def __init__(self, weights: object, keep: Sequence[int]):
        self._weights, self._keep = weights, list(keep)
        if hasattr(weights, "source"):
            self.source = lambda names: weights.source(tuple(map(self._name, names)))

    def _name(self, name: str) -> str:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        return f"blk.{self._keep[int(m[1])]}.{m[2]}" if m else name

    def raw(self, name: str) -> np.ndarray:
        return self._weights.raw(self._name(name))

    def tensor_type(self, name: str) -> int:
        return self._weights.tensor_type(self._name(name))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._weights.tensor_shape(self._name(name))

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self._weights.read_rows(self._name(name), ids)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        self._weights.release(self._name(name), rows)


def skipped_layers_graph(model: LoadedModel, keep: Sequence[int]) -> tuple[Graph, HParams]:
    """``model``'s forward pass through its layers ``keep`` only (a layer-skipping draft)."""
    from dynalm.ir.passes import optimize
    from dynalm.models.arch import build_graph, tensor_types

    hp, keep = model.hparams, list(keep)
    if not keep or sorted(set(keep)) != keep or keep[-1] >= hp.n_layers:
        raise InvalidRequest(f"layers to keep must be increasing ids below {hp.n_layers}")
    meta = dict(model.gguf.metadata)
    meta[f"{hp.arch}.block_count"] = len(keep)
    for key, value in meta.items():  # per-layer metadata follows its layers
        if isinstance(value, list) and len(value) == hp.n_layers and key.startswith(hp.arch):
            meta[key] = [value[i] for i in keep]
    types = {}
    for name, t in tensor_types(model.gguf).items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None:
            types[name] = t
        elif int(m[1]) in keep:
            types[f"blk.{keep.index(int(m[1]))}.{m[2]}"] = t
    hp = dataclasses.replace(hp, n_layers=len(keep))
    return optimize(build_graph(hp, meta, types)), hp


class ModelDrafter(Drafter):
    """Drafts greedily with a model graph of the target's vocabulary, run as the engine runs
    its own: an executor over a paged KV pool, one sequence per request that follows the
    target's tokens (after a rejection it rolls back to the tokens they share), each pass
    of the draft model one flat batch of every drafting sequence."""

    def __init__(
        self,
        name: str,
        graph: Graph,
        weights: object,
        hp: HParams,
        device: Device,
        *,
        cost: float,
        n_vocab: int,
        ctx: int,
        max_num_seqs: int,
        max_tokens: int = 512,
        page_size: int = 16,
    ):
        self.name, self.cost, self.n_vocab = name, cost, n_vocab
        # sized as the engine sizes its own f16 pool for the same contexts
        config = EngineConfig(ctx=ctx, max_num_seqs=max_num_seqs, page_size=page_size)
        n_tokens, _ = kv_pool_size(hp, config)
        self.pool = PagePool(
            hp.n_layers,
            hp.n_kv_heads,
            hp.head_dim,
            -(-n_tokens // page_size),
            page_size,
            device=device,
        )
        self.kv = KVCacheManager(self.pool, RadixCache(self.pool, enabled=False))
        self.executor = Executor(graph, device, weights, max_tokens=max_tokens, context=ctx)
        self.max_tokens = max_tokens
        self._seqs: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # tokens each sequence shares with its target
        self.steps = StepCost()  # its passes' times, measured

    def pass_time(self, n_seqs: int, target: StepCost) -> float:
        if self.steps.measured and target.measured:  # both in seconds
            return self.steps(n_seqs)
        return super().pass_time(n_seqs, target)

    @classmethod
    def for_model(
        cls, draft: LoadedModel, target: LoadedModel, device: Device, **config: int
    ) -> ModelDrafter:
        """``draft`` drafting for ``target`` (checked: same vocabulary, smaller)."""
        check_vocabularies(draft, target)
        return cls(
            draft.name,
            draft.graph,
            draft.weights,
            draft.hparams,
            device,
            cost=draft.gguf.path.stat().st_size / target.gguf.path.stat().st_size,
            n_vocab=target.hparams.n_vocab,
            **config,
        )

    @classmethod
    def layer_skip(
        cls,
        target: LoadedModel,
        device: Device,
        keep: Sequence[int] | None = None,
        **config: int,
    ) -> ModelDrafter:
        """The target with some layers skipped as its own draft; by default it skips the
        middle eighth of its layers (SmolLM2-135M, 30 layers: skipping 2 middle ones kept
        ~27 % of drafts, every third one none; deep models tolerate more)."""
        n = target.hparams.n_layers
        if keep is None:
            lo = (n - n // 8) // 2
            keep = [i for i in range(n) if not lo <= i < lo + n // 8]
        graph, hp = skipped_layers_graph(target, keep)
        weights = _RenamedLayers(target.weights, keep)
        name = f"{target.name} on {len(keep)} of {n} layers"
        return cls(
            name, graph, weights, hp, device, cost=len(keep) / n, n_vocab=target.hparams.n_vocab,
            **config,
        )  # fmt: skip

    def _follow(self, req: Request) -> Request:
        """The draft sequence of ``req``, rolled back to the tokens it shares with it."""
        rid = req.request_id
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = Request(rid, [], 0)
            self._synced[rid] = 0
        same, mine = self._synced[rid], seq.token_ids
        while same < min(len(mine), req.num_tokens) and mine[same] == req.token_ids[same]:
            same += 1
        if same < seq.num_computed_tokens:
            self.kv.rollback(seq, same)
        del mine[same:]
        mine += req.token_ids[same:]
        self._synced[rid] = req.num_tokens
        return seq

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        want = {i: k for i, k in enumerate(ks) if k}
        seqs = {i: self._follow(requests[i]) for i in want}
        while want:
            budget, chunks, owners = self.max_tokens, [], []
            for i in list(want):
                seq = seqs[i]
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 0:
                    break
                if not self.kv.allocate(seq, seq.num_computed_tokens + n):
                    del want[i]  # the draft pool is full: this one goes without a draft
                    self.release(seq.request_id)
                    continue
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                owners.append(i)
                budget -= n
            if not chunks:
                break
            t0, setup = time.perf_counter(), self.executor.setup_seconds
            tokens, positions, batch = flat_batch(self.pool, chunks)
            ends = batch.query_start[1:] - 1
            sampling = [j for j, c in enumerate(chunks) if c.samples]
            logits = self.executor.run(tokens, positions, ends[sampling], batch)
            best = logits.argmax(axis=1).tolist()
            setup = self.executor.setup_seconds - setup  # (compiling a new shape)
            self.steps.record(len(tokens), time.perf_counter() - t0 - setup)
            for chunk in chunks:
                chunk.request.num_computed_tokens = chunk.start + chunk.n
            for row, j in enumerate(sampling):
                i, token = owners[j], best[row]
                if token >= self.n_vocab:  # a padding row of a larger draft vocabulary
                    del want[i]
                    continue
                seqs[i].token_ids.append(token)
                drafts[i].tokens.append(token)
                want[i] -= 1
                if not want[i]:
                    del want[i]
        return drafts

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._synced.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)


DRAFTERS = ("ngram", "layer-skip")


def build_drafter(
    speculative: str | None,
    draft: LoadedModel | None,
    target: LoadedModel,
    device: Device,
    *,
    ctx: int,
    max_num_seqs: int,
    num_draft_tokens: int,
) -> Drafter | None:
    """The drafter of ``--speculative`` (ngram | layer-skip) or ``--draft`` (a model)."""
    check_num_draft_tokens(num_draft_tokens)
    if speculative is not None and draft is not None:
        raise InvalidRequest("--draft and --speculative exclude each other: choose one drafter")
    if speculative not in (None, *DRAFTERS):
        raise InvalidRequest(
            f"--speculative {speculative!r}: choose from {', '.join(DRAFTERS)} (or --draft MODEL)"
        )
    config = {"ctx": ctx, "max_num_seqs": max_num_seqs}
    if draft is not None:
        return ModelDrafter.for_model(draft, target, device, **config)
    if speculative == "ngram":
        return NgramDrafter()
    if speculative == "layer-skip":
        return ModelDrafter.layer_skip(target, device, **config)
    return None
