"""``dynalm bench``: llama-bench style prompt-processing (pp) and generation (tg) speed.

* ``ppN``: prefill of N random prompt tokens from an empty cache (one request with
  ``max_tokens=1``, chunked by the engine's step token budget), as tokens/s.
* ``tgN``: N single-token decode steps after a short prompt, as tokens/s.

``--speculative ngram`` (or ``layer-skip``) runs every test also with that drafter,
alternating with the plain engine, and reports the speed-up and the acceptance rate.

``--vs llama.cpp`` runs the same GGUF in llama-cpp-python (the ``dynalm[bench]`` extra),
alternating the two engines run by run, so both see the same load on a shared
machine; the ratio column is what to compare. ``--profile`` splits a decode step into
time inside each kind of kernel and time outside kernels (executor, scheduler,
sampling: the Python overhead).

Peak RSS is DynaLM's own: ``getrusage`` reports the whole process, so it is read after
DynaLM's warm-up pass (one run of every test) and before llama.cpp is loaded.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from dynalm.core import cpu_device
from dynalm.core import memory as process_memory
from dynalm.errors import InvalidRequest
from dynalm.flags import MAX_TOKENS, parse_int
from dynalm.runtime.engine.build import EngineSpec, build_engine
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.memory_plan import MemoryPlan, peak_rss
from dynalm.runtime.engine.sampling import SamplingParams

TG_PROMPT = 8  # tokens of context before a tg test's timed decode steps
INSTALL_HINT = "--vs llama.cpp needs llama-cpp-python: pip install 'dynalm[bench]'"


@dataclass(frozen=True)
class Test:
    kind: str  # "pp" | "tg"
    n: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}"


class Runner(Protocol):
    name: str

    def prefill(self, ids: list[int]) -> float:
        """Seconds to process ``ids`` from an empty cache."""

    def decode(self, prompt: list[int], ids: list[int]) -> float:
        """Seconds for ``len(ids)`` single-token steps after ``prompt``."""


def bench_config(ctx: int, num_draft_tokens: int = 4, kv_cache_dtype: str = "f16") -> EngineConfig:
    """The engine configuration of a bench run: one sequence, no prefix cache."""
    return EngineConfig(
        ctx=ctx,
        max_num_seqs=1,
        enable_prefix_caching=False,
        num_draft_tokens=num_draft_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )


class DynaLMRunner:
    """The engine through its public request API (one request at a time, no prefix
    cache, greedy), so a test costs what a user's request costs."""

    name = "dynalm"

    def __init__(self, engine: Engine):
        self.engine = engine
        if engine.planner is not None:
            self.name = f"dynalm+{engine.planner.drafter.name}"
        self._n = 0
        executor = engine.executor
        self._moe = any(node.op == "expert_matmul" for node in executor.graph.nodes)
        # over the decode steps: the expert matmuls' bytes read, their dense equivalent's
        # (`Executor.expert_reads`), and the tokens
        self.decode_experts = [0, 0, 0]

    def _request(
        self, prompt: list[int], max_tokens: int
    ) -> tuple[list[float], list[tuple[int, int]]]:
        """Run one request; the time at which each step that produced a token ended, and
        (for a mixture of experts) the expert matmuls' reads by then."""
        self._n += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
        self.engine.add_request(f"bench-{self._n}", prompt, params, stop_ids=frozenset())
        reads = self.engine.executor.expert_reads if self._moe else lambda: (0, 0)
        marks, read = [time.perf_counter()], [reads()]
        while self.engine.has_unfinished():
            if any(out.token_ids for out in self.engine.step()):
                marks.append(time.perf_counter())
                read.append(reads())
        return marks, read

    def prefill(self, ids: list[int]) -> float:
        marks, _ = self._request(ids, 1)
        return marks[1] - marks[0]

    def decode(self, prompt: list[int], ids: list[int]) -> float:
        # The first token comes out of the prefill; the next len(ids) are decode steps.
        marks, read = self._request(prompt, len(ids) + 1)
        (r0, d0), (r1, d1) = read[1], read[-1]
        self.decode_experts[0] += r1 - r0
        self.decode_experts[1] += d1 - d0
        self.decode_experts[2] += len(ids)
        return marks[-1] - marks[1]


class LlamaCppRunner:
    """The same GGUF in llama-cpp-python, in a process of its own (``eval`` over the prompt
    / one token at a time, timed there). In-process, llama.cpp's OpenMP threads and ours
    (and OpenBLAS's) spin-wait beside each other between runs: on a 2-core machine that
    cost llama.cpp up to 10x, which would flatter the ratio."""

    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, ctx: int, kv_cache_dtype: str = "f16"):
        import multiprocessing

        mp = multiprocessing.get_context("spawn")
        self._conn, child = mp.Pipe()
        args = (child, str(path), threads, ctx, kv_cache_dtype)
        self._proc = mp.Process(target=_llama_cpp_worker, args=args, daemon=True)
        self._proc.start()
        child.close()
        self._call("ready")

    def _call(self, *request: object) -> float:
        self._conn.send(request)
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise InvalidRequest("llama.cpp's worker process died (see its stderr)") from None
        if kind == "error":
            raise InvalidRequest(f"llama.cpp: {value}")
        return value

    def prefill(self, ids: list[int]) -> float:
        return self._call("prefill", ids)

    def decode(self, prompt: list[int], ids: list[int]) -> float:
        return self._call("decode", prompt, ids)

    def close(self) -> None:
        self._conn.close()
        self._proc.join(timeout=30)


# The KV cache types llama.cpp takes for ours (``-ctk``/``-ctv``: GGML type ids).
LLAMA_CPP_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}


def _llama_cpp_worker(conn, path: str, threads: int, ctx: int, kv_cache_dtype: str) -> None:  # noqa: ANN001
    """``LlamaCppRunner``'s process: answers (what, *args) with ("ok", seconds)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        conn.send(("error", INSTALL_HINT))
        return
    kv = LLAMA_CPP_KV_TYPES[kv_cache_dtype]
    try:
        llm = Llama(
            model_path=path,
            n_ctx=ctx,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=kv,
            type_v=kv,
            flash_attn=kv_cache_dtype == "q8_0",  # llama.cpp's quantised V needs it
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            what, *args = conn.recv()
        except EOFError:
            return
        if what == "ready":
            conn.send(("ok", 0.0))
            continue
        llm.reset()  # each run starts from an empty KV cache
        if what == "decode":
            prompt, ids = args
            llm.eval(prompt)
        else:
            ids = args[0]
        t0 = time.perf_counter()
        if what == "decode":
            for token in ids:
                llm.eval([token])
        else:
            llm.eval(ids)
        conn.send(("ok", time.perf_counter() - t0))


@dataclass
class Result:
    engine: str
    test: str
    rates: list[float] = field(default_factory=list)  # tokens/s, one per run

    def as_json(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "test": self.test,
            "tokens_per_s": statistics.fmean(self.rates),
            "sd": statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0,
            "runs": len(self.rates),
            "per_run": self.rates,  # in the order run (engines alternate run by run)
        }


class Workload:
    """The token ids of each test, drawn once so every runner and run sees the same."""

    def __init__(self, tests: list[Test], n_vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.tests = tests
        self.ids = {t.name: rng.integers(0, n_vocab, t.n).tolist() for t in tests}
        self.prompt = rng.integers(0, n_vocab, TG_PROMPT).tolist()

    def once(self, runner: Runner, test: Test) -> float:
        """One run of ``test``, in tokens/s."""
        if test.kind == "pp":
            return test.n / runner.prefill(self.ids[test.name])
        return test.n / runner.decode(self.prompt, self.ids[test.name])

    def warm_up(self, runner: Runner) -> None:
        """Each test once untimed (JIT compiles, first binding, buffers)."""
        for test in self.tests:
            self.once(runner, test)

    def rounds(self, runners: list[Runner], repetitions: int) -> list[Result]:
        """``repetitions`` rounds; within a round the runners alternate so they share the
        machine's load."""
        results = {(r.name, t.name): Result(r.name, t.name) for t in self.tests for r in runners}
        for _ in range(repetitions):
            for test in self.tests:
                for runner in runners:
                    results[runner.name, test.name].rates.append(self.once(runner, test))
        return list(results.values())


PARTS = ("attention", "ffn", "router", "experts", "head", "other")


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step (one token) reads of a GGUF's tensors, by part: the whole of
    each tensor but the token embedding (one row per token: nothing, unless it is also the
    output head) and, of a mixture of experts' stacked ``ffn_*_exps`` tensors, the
    ``top_k`` of ``n_experts`` experts the token is routed to."""

    parts: dict[str, int]  # of PARTS; "experts": all of them
    top_k: int = 0
    n_experts: int = 0

    @property
    def experts(self) -> int:
        """The experts one token selects: top_k / n_experts of them all (0: dense)."""
        all_experts = self.parts.get("experts", 0)
        return all_experts * self.top_k // self.n_experts if self.n_experts else 0

    @property
    def per_token(self) -> int:
        return self.dense - self.parts.get("experts", 0) + self.experts

    @property
    def dense(self) -> int:
        """The dense equivalent: every expert read every step."""
        return sum(self.parts.values())

    def line(self) -> str:
        mib = 2**20
        shown = {part: self.parts.get(part, 0) for part in PARTS}
        if self.n_experts:
            shown["experts"] = self.experts
        items = ", ".join(f"{k} {v / mib:,.1f}" for k, v in shown.items() if v)
        text = f"decode reads {self.per_token / mib:,.1f} MiB/token of the file ({items})"
        if self.n_experts:
            text += (
                f": {self.top_k} of {self.n_experts} experts per layer, "
                f"{self.per_token / self.dense:.1%} of the dense equivalent's "
                f"{self.dense / mib:,.1f} MiB (every expert)"
            )
        return text


def _tensor_part(name: str) -> str:
    if name in ("output.weight", "token_embd.weight"):
        return "head"
    if "_exps." in name:  # ffn_{gate,up,down}_exps: [n_expert, rows, cols]
        return "experts"
    if "ffn_gate_inp" in name:
        return "router"
    for part in ("attn", "ffn"):
        if f".{part}_" in name and "norm" not in name:
            return "attention" if part == "attn" else part
    return "other"  # norms, biases, small tensors


def file_decode_bytes(path: Path) -> DecodeBytes:
    """`DecodeBytes` of a GGUF file (the bytes llama.cpp reads per decoded token)."""
    from dynalm.models.gguf_file import GGUFFile

    with GGUFFile(path) as gguf:
        tensors, meta = gguf.tensors, gguf.metadata
        arch = meta.get("general.architecture", "")
        tied = "output.weight" not in tensors
        parts: dict[str, int] = {}
        for name, t in tensors.items():
            if tied or name != "token_embd.weight":
                part = _tensor_part(name)
                parts[part] = parts.get(part, 0) + t.nbytes
        n_experts = int(meta.get(f"{arch}.expert_count", 0))
        top_k = int(meta.get(f"{arch}.expert_used_count", 0))
    return DecodeBytes(parts, top_k, n_experts) if "experts" in parts else DecodeBytes(parts)


def experts_line(runner: DynaLMRunner, read: DecodeBytes) -> str:
    """What DynaLM's expert matmuls read per decoded token (their counters) against the
    experts a token selects; "" for a dense model or before any decode step."""
    nbytes, dense, tokens = runner.decode_experts
    if not (dense and tokens and read.n_experts):
        return ""
    mib, per_token, every = 2**20, nbytes / tokens, dense / tokens
    selected = every * read.top_k / read.n_experts
    return (
        f"dynalm's expert matmuls read {per_token / mib:,.1f} MiB/token: "
        f"{per_token / selected:.1%} of the {read.top_k} selected experts' "
        f"{selected / mib:,.1f} MiB, {per_token / every:.1%} of all {read.n_experts} "
        f"({every / mib:,.1f} MiB, as DynaLM prepares them)"
    )


def decode_bandwidth(
    results: list[Result], ours: int, file_bytes: int, roof: float | None = None
) -> str:
    """What each engine's tg rate streams: its weight bytes per token times tokens/s; with
    ``roof`` (``cpu_device.streaming_read_gbs``, GB/s), each as a share of it."""
    rates = {r.engine: statistics.fmean(r.rates) for r in results if r.test.startswith("tg")}
    if not rates:
        return ""
    mib = 2**20
    parts = []
    for engine, rate in rates.items():
        nbytes = file_bytes if engine == "llama.cpp" else ours
        gbs = nbytes * rate / 1e9
        share = f" ({gbs / roof:.0%} of the roof)" if roof else ""
        parts.append(f"{engine} {nbytes / mib:,.0f} MiB x {rate:.1f} t/s = {gbs:.1f} GB/s{share}")
    line = "decode streams weights per token: " + "; ".join(parts)
    if roof:
        line += f"\nroof: the host's streaming read {roof:.1f} GB/s, measured after the runs"
    return line


PLAN_MARGIN = 0.10  # the memory plan's accuracy (tests/models/test_memory_plan.py)


@dataclass
class Memory:
    """DynaLM's peak RSS against the budget: the engine's memory plan + 10 %."""

    peak_rss: int
    file: int
    plan: MemoryPlan

    @property
    def kv(self) -> int:
        return self.plan.kv

    @property
    def budget(self) -> int:
        return int(self.plan.total * (1 + PLAN_MARGIN))

    @property
    def within_budget(self) -> bool:
        return self.peak_rss <= self.budget

    def as_json(self) -> dict[str, int | bool]:
        sizes = {f"{k}_bytes": getattr(self, k) for k in ("peak_rss", "file", "kv", "budget")}
        return {**sizes, "plan_bytes": self.plan.total, "within_budget": self.within_budget}

    def line(self) -> str:
        mb = 10**6
        verdict = "within" if self.within_budget else "OVER"
        return (
            f"dynalm peak RSS {self.peak_rss / mb:.1f} MB, {verdict} the budget "
            f"{self.budget / mb:.1f} MB = the {self.plan.line()} + {PLAN_MARGIN:.0%}"
        )


def format_table(results: list[Result], header: str, engines: list[str]) -> str:
    """A markdown table: tokens/s mean ± sd per engine, and the ratio of the first two."""
    by_test: dict[str, dict[str, dict[str, object]]] = {}
    for r in results:
        by_test.setdefault(r.test, {})[r.engine] = r.as_json()
    cols = ["test", *(f"{e} t/s" for e in engines)]
    if len(engines) == 2:
        cols.append(f"{engines[0]} / {engines[1]}")
    rows = []
    for test, per in by_test.items():
        row = [test]
        for e in engines:
            row.append(f"{per[e]['tokens_per_s']:.1f} ± {per[e]['sd']:.1f}")
        if len(engines) == 2:
            row.append(f"{per[engines[0]]['tokens_per_s'] / per[engines[1]]['tokens_per_s']:.2f}")
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([header, "", line(cols), sep, *(line(r) for r in rows)])


@dataclass
class StepProfile:
    test: Test
    steps: int
    step_tokens: float  # tokens per step
    step_seconds: float  # mean wall time of one step (engine.step)
    kernel_seconds: dict[str, float]  # per op type, per step
    calls: Counter[str]  # per op type, per step
    compiled_seconds: float  # the same steps unprofiled: runs of native calls as one program

    @property
    def outside_seconds(self) -> float:
        return self.step_seconds - sum(self.kernel_seconds.values())

    def as_json(self) -> dict[str, object]:
        return {
            "test": self.test.name,
            "steps": self.steps,
            "step_ms": self.step_seconds * 1e3,
            "kernel_ms": {op: s * 1e3 for op, s in self.kernel_seconds.items()},
            "outside_ms": self.outside_seconds * 1e3,
            "compiled_step_ms": self.compiled_seconds * 1e3,
        }

    def table(self) -> str:
        step = self.step_seconds
        kernels = sum(self.kernel_seconds.values())
        kind = "decode" if self.test.kind == "tg" else "prefill"
        lines = [
            f"{kind} step profile ({self.test.name}): {self.steps} steps, {step * 1e3:.2f} "
            f"ms/step ({self.step_tokens / step:.1f} tokens/s)",
            "",
            f"| {'op':<24} | calls/step |  ms/step | % of step |",
            f"|{'-' * 26}|------------|----------|-----------|",
        ]
        for op, s in sorted(self.kernel_seconds.items(), key=lambda kv: -kv[1]):
            lines.append(
                f"| {op:<24} | {self.calls[op]:>10} | {s * 1e3:8.3f} | {100 * s / step:8.1f}% |"
            )
        for label, calls, s in (
            ("all kernels", str(sum(self.calls.values())), kernels),
            ("outside kernels", "", self.outside_seconds),
        ):
            lines.append(f"| {label:<24} | {calls:>10} | {s * 1e3:8.3f} | {100 * s / step:8.1f}% |")
        compiled = self.compiled_seconds
        lines += [
            "",
            f"unprofiled, each run of native calls as one compiled program: {compiled * 1e3:.2f} "
            f"ms/step ({self.step_tokens / compiled:.1f} tokens/s, "
            f"{100 * (1 - compiled / step):.1f}% less)",
        ]
        return "\n".join(lines)


def profile_test(runner: DynaLMRunner, test: Test, n_vocab: int) -> StepProfile:
    """Per step of one bench test, time inside each op's kernel vs everything else in
    ``engine.step``: tg, the decode steps after a short prompt; pp, the prefill steps."""
    engine, executor = runner.engine, runner.engine.executor
    decode = test.kind == "tg"
    prompt = np.random.default_rng(1).integers(0, n_vocab, TG_PROMPT if decode else test.n)
    max_tokens = test.n + 1 if decode else 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)

    def timed(name: str, profile: dict[str, float] | None) -> tuple[float, int]:
        """Seconds per step of one request, and its steps."""
        engine.add_request(name, prompt.tolist(), params, stop_ids=frozenset())
        if decode:
            engine.step()  # the prefill (and first token): not a decode step
        executor.profile = profile
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        executor.profile = None
        return (time.perf_counter() - t0) / steps, steps

    kernels: dict[str, float] = {}
    step, steps = timed("bench-profile", kernels)
    compiled, _ = timed("bench-compiled", None)
    per_step = {op: s / steps for op, s in kernels.items()}
    tokens = 1.0 if decode else test.n / steps
    return StepProfile(test, steps, tokens, step, per_step, Counter(executor.ops), compiled)


def parse_tests(n_prompt: str, n_gen: str) -> list[Test]:
    """``-p 128,512 -n 128`` -> pp128, pp512, tg128 (0 skips a kind, as in llama-bench)."""
    tests = []
    for kind, flag, spec in (("pp", "-p", n_prompt), ("tg", "-n", n_gen)):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            count = parse_int(part, f"each token count of {flag}", 0, MAX_TOKENS)
            if count:
                tests.append(Test(kind, count))
    if not tests:
        raise InvalidRequest("nothing to run: give -p and/or -n token counts")
    return tests


def bench_command(
    path: Path,
    tests: list[Test],
    *,
    threads: int | None,
    repetitions: int,
    mode: str,
    vs: str | None,
    backend: str = "auto",
    as_json: bool,
    profile: bool,
    speculative: str | None = None,
    num_draft_tokens: int = 4,
    kv_cache_dtype: str = "f16",
) -> str:
    """Everything ``dynalm bench`` prints to stdout."""
    import importlib.util
    import json

    from dynalm.models.loader import load_model

    if vs not in (None, "llama.cpp"):
        raise InvalidRequest(f"--vs: only 'llama.cpp' is supported, got {vs!r}")
    if repetitions < 1:
        raise InvalidRequest(f"-r must be at least 1, got {repetitions}")
    if kv_cache_dtype not in LLAMA_CPP_KV_TYPES:
        kinds = ", ".join(LLAMA_CPP_KV_TYPES)
        raise InvalidRequest(f"--kv-cache-dtype: one of {kinds}, got {kv_cache_dtype!r}")
    if speculative and (vs or profile):
        raise InvalidRequest(
            "--speculative compares with the plain engine: not with --vs or --profile"
        )
    ctx = max(t.n for t in tests) + TG_PROMPT + 16
    if vs and importlib.util.find_spec("llama_cpp") is None:  # fail before loading anything
        raise InvalidRequest(INSTALL_HINT)
    t0 = time.perf_counter()
    model = load_model(path)
    t1 = time.perf_counter()
    config = bench_config(ctx, kv_cache_dtype=kv_cache_dtype)
    ours = DynaLMRunner(build_engine(EngineSpec(model, config, backend, mode, threads)))
    device, n_vocab = ours.engine.device, model.hparams.n_vocab
    load = {  # binding repacks the weights, or reads them from the repack cache
        "file_s": round(t1 - t0, 3),
        "bind_s": round(time.perf_counter() - t1, 3),
        "repack_s": round(device.repack_seconds, 3),
        "weights_repacked": device.repacked,
        "weights_mapped": device.mapped,
        "weight_pages": "huge" if process_memory.huge_pages() else "mapped",  # (CPU weights)
        "peak_rss_bytes": peak_rss(),
    }
    summary = {"model": model.name, "file": str(path), "threads": device.threads, "mode": mode}
    summary["kv_cache_dtype"] = kv_cache_dtype
    summary["load"] = load
    submitted = getattr(device, "submitted", None)  # the CUDA device's launches per step shape
    if profile:
        for test in tests:  # warm-up: JIT compiles, first binding of each step shape
            profile_test(ours, test, n_vocab)
        profiles = [profile_test(ours, test, n_vocab) for test in tests]
        if as_json:
            return json.dumps({**summary, "profiles": [p.as_json() for p in profiles]})
        head = (
            f"model {model.name} · file {path} · threads {device.threads} · mode {mode} · "
            f"KV {kv_cache_dtype}"
        )
        return "\n\n".join([head, *(p.table() for p in profiles)])
    work = Workload(tests, n_vocab)
    work.warm_up(ours)
    memory = Memory(peak_rss(), path.stat().st_size, ours.engine.memory_plan)
    runners: list[Runner] = [ours]
    if speculative:  # first, so that the ratio column is the speed-up
        config = bench_config(ctx, num_draft_tokens, kv_cache_dtype)
        spec = EngineSpec(model, config, speculative=speculative, device=device)
        runners.insert(0, DynaLMRunner(build_engine(spec)))
        work.warm_up(runners[0])
        runners[0].engine.spec_stats.__init__()  # count the timed runs only
    if vs:
        runners.append(LlamaCppRunner(path, device.threads, ctx, kv_cache_dtype))
        work.warm_up(runners[-1])
    results = work.rounds(runners, repetitions)
    for runner in runners[1:]:
        if isinstance(runner, LlamaCppRunner):
            runner.close()
    spec = runners[0].engine.spec_stats if speculative else None  # type: ignore[attr-defined]
    read = file_decode_bytes(path)
    weights, file_bytes = ours.engine.memory_plan.weights, read.per_token
    decoded = any(r.test.startswith("tg") for r in results)
    # the CPU's memory roof, on the threads the engines ran (a GPU reads its own memory)
    cpu = decoded and submitted is None
    roof = cpu_device.streaming_read_gbs(device.threads) if cpu else None
    experts = experts_line(ours, read)
    if experts:  # a mixture: the experts its decode steps read, not every expert
        nbytes, dense, tokens = ours.decode_experts
        weights += round((nbytes - dense) / tokens)
    if as_json:
        extra = {} if spec is None else {"acceptance_rate": spec.acceptance_rate}
        if submitted is not None:
            extra["gpu_steps"] = [
                {"tokens": t, "logit_rows": s, "launches": n, "kernels": k}
                for (t, s), (n, k) in sorted(submitted.items())
            ]
        return json.dumps(
            {
                **summary,
                "results": [r.as_json() for r in results],
                "memory": memory.as_json(),
                "stream_gbs": roof,
                "decode_bytes": {
                    "dynalm": weights,
                    "file": file_bytes,
                    "file_dense": read.dense,
                    "file_experts": read.experts,
                    # per decoded token: the expert matmuls' reads, and every expert's bytes
                    "dynalm_experts": ours.decode_experts[0] / max(1, ours.decode_experts[2]),
                    "dynalm_experts_all": ours.decode_experts[1] / max(1, ours.decode_experts[2]),
                },
                **extra,
            }
        )
    header = (
        f"model {model.name} · file {path} ({memory.file / 2**20:.1f} MiB) · "
        f"threads {device.threads} · mode {mode} · KV {kv_cache_dtype} · {repetitions} runs"
        + (", engines alternating" if vs else "")
        + (
            " (llama.cpp: the same KV type, flash attention)"
            if vs and kv_cache_dtype == "q8_0"
            else ""
        )
    )
    loaded = (
        f"load: file {load['file_s']:.2f} s, bind {load['bind_s']:.2f} s (weight repack "
        f"{load['repack_s']:.2f} s; {load['weights_mapped']} of "
        f"{load['weights_mapped'] + load['weights_repacked']} weights from the repack cache; "
        f"on {'2 MiB huge pages' if load['weight_pages'] == 'huge' else 'mapped file pages'}), "
        f"peak RSS after load {load['peak_rss_bytes'] / 10**6:.1f} MB"
    )
    table = format_table(results, header, [r.name for r in runners])
    if bandwidth := decode_bandwidth(results, weights, file_bytes, roof):
        table += f"\n\n{bandwidth}"
        if experts:
            table += f"\n{read.line()}\n{experts}"
    if spec is not None:
        table += f"\n\n{spec.summary()}"
    if submitted:
        shapes = sorted(submitted.items())
        steps = ", ".join(f"{t} token(s): {n} launch(es), {k} kernels" for (t, _), (n, k) in shapes)
        loaded += f"\nGPU driver launches per step ({steps})"
    return f"{table}\n\n{memory.line()}\n{loaded}"
