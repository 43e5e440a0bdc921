"""A mixture of experts' weights ``[E, N, K]`` and the expert-grouped matmul over them.

Each expert is an ordinary matmul weight ``[N, K]`` (a ``QuantMatmul`` in ``exact`` and
``auto``), prepared by the device when a route first selects it: an expert never routed to
is never read from the model file. A step's (token, slot) pairs are grouped by expert; each
selected expert multiplies only its rows, all of them in one ``GroupedMatmul`` job (one
barrier per call, ``auto``'s activations quantised once): the rows are gathered by expert
and the products scattered to their slots, except where every expert has one row (a decode
step), which reads x and writes out in place. Every row of a ``QuantMatmul`` sums in the
same order whatever its batch (``core.matmul``), so a slot's result is bitwise the expert's
own matmul of that row, alone or grouped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from dynalm.core import elementwise, memory
from dynalm.core.cpu_ops import route_ids
from dynalm.core.grouped_matmul import GroupedMatmul
from dynalm.core.matmul import CACHED_ROWS, ActivationScratch, QuantMatmul
from dynalm.kernel import backends

MatmulFn = Callable[[np.ndarray, np.ndarray], None]  # (x [rows, K], out [rows, N])

# A small step's (token, slot) pairs each read their expert's weights (``step_records``);
# grouping the pairs by expert instead is Python between native programs. Steps run natively
# while the expected re-reads (the pairs beyond the distinct experts they name) stay within
# this many bytes. Measured on the OLMoE-shaped file (64 experts of 1.2-1.7 MB, top 8; Zen
# 2; `benchmarks/batched_decode.py`), sequences decoding together natively against grouped
# from Python: 1.2-1.4x at 2-4 sequences, 1.08x at 6, 0.96-0.98x at 8 (~40 MB re-read a
# call); so up to 7 tokens there, 2 of Mixtral 8x7B's 33 MB experts.
NATIVE_REREAD_BYTES = 32 * 2**20


class ExpertScratch:
    """A call's (token, slot) rows gathered in expert order and their products: one buffer
    per executor (expert matmuls run one at a time), grown, never shrunk; its views cached
    per (rows, K, N). ``quantised``: the gathered rows' int8 quantisation (auto), made by
    copying the rows of ``sources``, the quantisation of the rows they are gathered from.

    ``grouped`` counts the grouped matmuls its experts made (a compiled small step runs an
    expert matmul natively once it has one); ``waiting_since`` that count when a step
    was compiled without one (else None): the executor compiles its steps again once more
    are made (``CpuBinder.stale``). ``error``: what preparing an expert raised inside a
    native step (``Experts.step_records``), raised when the step ends."""

    def __init__(self) -> None:
        self.quantised, self.sources = ActivationScratch(), ActivationScratch()
        self.grouped = 0
        self.waiting_since: int | None = None
        self.error: BaseException | None = None
        self._buffer = np.empty(0, np.float32)
        self._views: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def views(self, rows: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """fp32 ``[rows, K]`` (gathered inputs) and ``[rows, N]`` (their products)."""
        key = (rows, k, n)
        found = self._views.get(key)
        if found is None:
            need = rows * (k + n)
            if need > self._buffer.size:
                self._buffer = np.empty(max(need, 2 * self._buffer.size), np.float32)
                self._views.clear()
            b = self._buffer
            found = self._views[key] = (
                b[: rows * k].reshape(rows, k),
                b[rows * k : need].reshape(rows, n),
            )
        return found


class Experts:
    """``E`` matmul weights ``[N, K]``, each made by ``prepare(e)`` when first used;
    ``scratch`` holds the rows gathered for the experts (shared by an executor's experts).

    ``bytes_read`` adds, per call, the prepared bytes of the experts it selected
    (``expert_bytes`` each): what a step reads of the weights, against ``E * expert_bytes``
    for the dense equivalent; ``calls`` counts the calls (both counted in ``_read``, which
    the native ``select_experts`` kernel adds to as well).

    A small step's call (a few tokens: decoding) can run as native records
    (``step_records``): a job bound once whose experts a native kernel names, calling back
    into Python to prepare one not used before."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        expert_bytes: int,
        prepare: Callable[[int], MatmulFn],
        scratch: ExpertScratch,
    ) -> None:
        self.shape = shape
        self.expert_bytes = expert_bytes
        self._prepare = prepare
        self._matmuls: list[MatmulFn | None] = [None] * shape[0]
        self._ready = np.zeros(shape[0], bool)
        self._weights = np.zeros(shape[0], np.int64)  # JIT experts' weights' addresses
        self._grouped: GroupedMatmul | None = None  # made with the first JIT expert
        self._miss = elementwise.MISS(self._prepared_at)  # (kept: native code calls it)
        self._zeros: np.ndarray | None = None  # weights of zeros: an expert that failed
        self._scratch = scratch
        self._read = np.zeros(2, np.int64)  # experts read, calls

    @property
    def bytes_read(self) -> int:
        return int(self._read[0]) * self.expert_bytes

    @property
    def calls(self) -> int:
        return int(self._read[1])

    @functools.cache  # noqa: B019 - a few top_k values, the object lives as long as its model
    def native_tokens(self, top_k: int) -> int:
        """The most tokens a step may hold to run natively (``NATIVE_REREAD_BYTES``): its
        T top_k pairs name about E (1 - (1 - 1/E)^(T top_k)) distinct experts of E."""
        n_experts, tokens = self.shape[0], 1
        while tokens < CACHED_ROWS:
            pairs = (tokens + 1) * top_k
            distinct = n_experts * (1 - (1 - 1 / n_experts) ** pairs)
            if (pairs - distinct) * self.expert_bytes > NATIVE_REREAD_BYTES:
                break
            tokens += 1
        return tokens

    def native_steps(self) -> bool:
        """Whether a small step compiled now runs natively (``step_records``): once a JIT
        expert is prepared; until then the step waits for one (``ExpertScratch``)."""
        if self._grouped is None and self._scratch.waiting_since is None:
            self._scratch.waiting_since = self._scratch.grouped
        return self._grouped is not None

    @property
    def prepared(self) -> list[int]:
        """The experts prepared so far (routed to at least once)."""
        return np.flatnonzero(self._ready).tolist()

    def matmul(self, e: int) -> MatmulFn:
        """Expert ``e``'s matmul, prepared on first use."""
        mm = self._matmuls[e]
        if mm is None:
            mm = self._matmuls[e] = self._prepare(e)
            self._ready[e] = True
            if isinstance(mm, QuantMatmul):
                self._weights[e] = mm.weights.__array_interface__["data"][0]
                if self._grouped is None:
                    scratch = self._scratch
                    self._grouped = GroupedMatmul(
                        mm, self.shape[0], scratch.quantised, scratch.sources
                    )
                    self._scratch.grouped += 1
        return mm

    def step_records(
        self,
        x: np.ndarray,
        route: np.ndarray,
        out: np.ndarray,
        bias: np.ndarray | None,
        backend: backends.Backend,
    ) -> tuple[list[tuple[int, int, int, int, int]], tuple]:
        """A small step's call (``x`` [T, K] or [T, top_k K], ``route`` [T, 2 top_k],
        ``out`` [T, top_k N]; ``native_steps`` first) as native records, and what they
        point into (kept by the caller): a kernel naming each (token, slot) pair's expert
        (prepared, called back, when first used) in a grouped job bound once, a one-row
        group per pair, then the experts' biases. (Pairs of one expert read its weights
        once each: a few tokens' pairs rarely share one, and grouping them is Python.)"""
        _, n, k_in = self.shape
        top_k = route.shape[1] // 2
        pairs = np.arange(out.size // n)  # f = t * top_k + j
        x_rows = x.reshape(-1, k_in)
        x_first = pairs if len(x_rows) == len(pairs) else pairs // top_k
        y_rows = out.reshape(-1, n)
        bound = self._grouped.bind_gemv(x_rows, x_first, y_rows, pairs)
        select = elementwise.select_experts(
            bound.weights, route, self._weights, self._read, self._miss, backend=backend
        )
        records, keep = select.records() + bound.records, (bound, select)
        if bias is not None:
            add = elementwise.expert_bias(y_rows, bias, route, backend=backend)
            records, keep = records + add.records(), (*keep, add)
        return records, keep

    def _prepared_at(self, e: int) -> int:
        """Expert ``e`` prepared (from native code): its weights' address. What that
        raises is kept for the step's end (``ExpertScratch.error``; ctypes would print and
        drop it), the expert's weights zeros meanwhile."""
        try:
            self.matmul(e)
            return int(self._weights[e])
        except BaseException as error:  # noqa: BLE001 - re-raised when the step ends
            self._scratch.error = self._scratch.error or error
            if self._zeros is None:
                self._zeros = np.zeros(self.expert_bytes + 64, np.uint8)
            return -(-self._zeros.ctypes.data // 64) * 64

    def __call__(
        self,
        x: np.ndarray,
        route: np.ndarray,
        out: np.ndarray,
        bias: np.ndarray | None = None,
        *,
        sorted_x: bool = False,
        sorted_out: bool = False,
    ) -> None:
        """``out [T, top_k * N]``: each slot's row of ``x`` (``[T, K]``: every slot reads
        row t; ``[T, top_k * K]``: slot j its columns j*K..) times its expert (see
        ``cpu_ops.expert_matmul``, the reference). With ``sorted_x``, ``x``'s rows
        (``[T, top_k * K]``) hold the pairs in expert order instead (sorted by expert,
        stably: what ``sorted_out`` writes for this route); with ``sorted_out``, the
        products go to ``out``'s rows in that order. An expert FFN keeps its rows so
        between its matmuls (``CpuBinder``): no scatter after gate and up, no gather before
        down, the same bits (a row's product does not depend on where it lies)."""
        n_experts, n, k_in = self.shape
        ids = route_ids(route, n_experts).ravel()  # pair f = t * top_k + j
        top_k = route.shape[1] // 2
        # x's and out's rows per pair: slot j of token t is row f of the [T * top_k, .] view
        x_rows, out_rows = x.reshape(-1, k_in), out.reshape(-1, n)
        if sorted_x and len(x_rows) != len(ids):
            raise ValueError(f"x of {len(x_rows)} rows in expert order: {len(ids)} pairs")
        pairs = ids.argsort(kind="stable")  # grouped by expert
        in_order = np.arange(len(pairs))
        source = in_order if sorted_x else pairs if len(x_rows) == len(ids) else pairs // top_k
        dest = in_order if sorted_out else pairs
        by_expert = ids[pairs]
        if not self._ready[by_expert].all():
            new = np.unique(by_expert[~self._ready[by_expert]]).tolist()
            if len(new) > 1:  # (their memory faulted in meanwhile, off this thread)
                memory.reserve_weights(self.expert_bytes, len(new))
            for e in new:
                self.matmul(e)
        if self._grouped is not None and (by_expert[1:] != by_expert[:-1]).all():
            # a row each (a decode step): x's rows read and out's written in place
            self._grouped(self._weights[by_expert], x_rows, source, None, out_rows, dest)
            starts = pairs  # (as many)
        else:
            starts = np.flatnonzero(np.diff(by_expert, prepend=-1))
            order = (sorted_x, sorted_out)
            self._by_groups(x_rows, source, by_expert, starts, out_rows, dest, *order)
        if bias is not None:
            out_rows[dest] += bias[by_expert]
        self._read += (len(starts), 1)

    def _by_groups(
        self,
        x_rows: np.ndarray,
        source: np.ndarray,
        by_expert: np.ndarray,
        starts: np.ndarray,
        out_rows: np.ndarray,
        dest: np.ndarray,
        sorted_x: bool,
        sorted_out: bool,
    ) -> None:
        """Experts of several rows: the rows gathered by expert (``sorted_x``: in that order
        already), the products scattered to ``dest`` (``sorted_out``: written in place)."""
        _, n, k_in = self.shape
        rows = len(dest)
        # large calls in auto gather int8 rows (``GroupedMatmul.gather``): no fp32 copies
        fp32 = not sorted_x and (self._grouped is None or self._grouped.copies_fp32(rows))
        xs, ys = self._scratch.views(rows, k_in if fp32 else 0, 0 if sorted_out else n)
        ys = out_rows[:rows] if sorted_out else ys
        # (native row copies: numpy's take and fancy assignment ran 1.4-4.5x slower)
        threads = 1 if self._grouped is None else self._grouped.threads
        if sorted_x:
            x = x_rows
        elif self._grouped is not None:
            x = self._grouped.gather(x_rows, source, xs)
        else:
            elementwise.rows(xs, x_rows, source)()
            x = xs
        if self._grouped is not None:  # one job for all
            counts = np.diff(starts, append=rows)
            self._grouped(self._weights[by_expert[starts]], x, starts, counts, ys, starts)
        else:  # formats without a JIT kernel: one expert's matmul at a time
            ends = [*starts[1:].tolist(), rows]
            for a, b in zip(starts.tolist(), ends, strict=True):
                self.matmul(int(by_expert[a]))(x[a:b], ys[a:b])
        if not sorted_out:
            slot_of = np.empty_like(dest)  # the scatter out[dest] = ys as a gather
            slot_of[dest] = np.arange(rows)
            elementwise.rows(out_rows, ys, slot_of, threads=threads)()
