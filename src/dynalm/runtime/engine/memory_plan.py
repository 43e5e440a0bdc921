"""The memory plan: what a model will hold once it runs, checked against what this machine
(or its cgroup) has, before any weight is read.

    weights      every weight as the device keeps it: a matmul's repacked blocks (the
                 kernel's planes per 32 columns), fp32 for norms, nothing for an embedding
                 table (its rows are read on demand); ``--mode safe``: fp32 everything
    KV pool      the engine's page pool at --ctx / --max-num-seqs / --kv-cache-dtype
                 (``engine.kv_pool_size``, the same arithmetic the engine allocates with)
    activations  the planner's buffers at the step's token budget (rows x widths x 4 B,
                 the logits included) + the int8 activation scratch + the experts' rows
    runtime      the interpreter and libraries (RUNTIME_BYTES) + the tokenizer
                 (TOKENIZER_BYTES_PER_TOKEN per vocabulary entry)

``plan_memory`` is the one entry point (``dynalm show``, ``run``/``serve`` with
``--verbose``, ``dynalm bench``'s budget, and ``Engine``, which refuses to start when the
plan does not fit). What a weight takes is the device's answer (``Device.prepared_bytes``,
for the use the op table gives each weight slot). ``tests/models/test_memory_plan.py``
holds it to within 10 % of the measured peak RSS of a run that fills its KV pool and its
step buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dynalm.core.kv_formats import KV_FORMATS, kv_format
from dynalm.core.quant import tensor_type
from dynalm.errors import DynaError
from dynalm.ir.ops import OPS

if TYPE_CHECKING:
    from dynalm.core.device import Device
    from dynalm.ir.graph import Graph
    from dynalm.models.hparams import HParams
    from dynalm.models.loader import LoadedModel
    from dynalm.runtime.engine.config import EngineConfig

# The interpreter's and libraries' own memory (heap, not their code pages, which are page
# cache: see library_rss). Measured on x86-64 Linux, Python 3.11, SmolLM2 at ctx 1024 with
# every KV row and step buffer filled: 279 MiB peak with the JIT's disk cache, 289 MiB
# when the JIT compiles (LLVM's heap), against 284 MiB planned with this figure.
RUNTIME_BYTES = 20 * 2**20
# The HF tokenizer's vocabulary and merges, and the GGUF's tokenizer metadata while it is
# built: ~40 MB measured for SmolLM2's 49152 tokens.
TOKENIZER_BYTES_PER_TOKEN = 800


class NotEnoughMemory(DynaError):
    """The memory plan does not fit the memory available."""


def mib(n: int) -> str:
    """Bytes for a message: MiB, GiB from 10 GiB."""
    return f"{n / 2**20:.0f} MiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def weight_bytes(graph: Graph, device: Device) -> int:
    """Bytes of the weights as ``device`` prepares them, each for the uses its op table
    slots give it (a tied table twice: a matmul's blocks and an embedding), from the graph's
    weight types alone: no weight is read."""
    uses: dict[tuple[str, str], tuple[int, tuple[int, ...]]] = {}  # the executor's key
    for node in graph.nodes:
        for slot, w in zip(OPS[node.op].weights, node.weights, strict=False):
            uses[w.name, slot.use] = (tensor_type(w.type.dtype), tuple(map(int, w.type.shape)))
    return sum(device.prepared_bytes(t, shape, use) for (_, use), (t, shape) in uses.items())


def kv_pool_size(hp: HParams, config: EngineConfig) -> tuple[int, int]:
    """``(tokens, bytes)`` of the engine's KV pool for ``config``: by default room for
    ``max_num_seqs`` full contexts, capped at 2 GiB but never below one context; with
    ``kv_cache_memory``, what that budget holds after the recent buffers (q8_0)."""
    from dynalm.errors import InvalidRequest

    fmt, shape = kv_format(config.kv_cache_dtype), (hp.n_layers, hp.n_kv_heads, hp.head_dim)
    per_token = fmt.token_bytes(*shape)
    buffers = config.max_num_seqs * fmt.recent_bytes(*shape)
    if config.kv_cache_memory is None:
        cap = DEFAULT_KV_CAP // per_token
        n_tokens = max(config.ctx, min(config.max_num_seqs * config.ctx, cap))
    else:
        n_tokens = max(0, config.kv_cache_memory - buffers) // per_token
        if n_tokens < config.ctx:
            raise InvalidRequest(
                f"--kv-cache-memory {config.kv_cache_memory} holds {n_tokens} tokens, "
                f"less than one full context ({config.ctx}); raise it or lower --ctx"
            )
    n_tokens = -(-n_tokens // config.page_size) * config.page_size  # whole pages
    return n_tokens, n_tokens * per_token + buffers


DEFAULT_KV_CAP = 2 << 30  # bytes: the default pool never exceeds this (beyond one full context)


def activation_bytes(graph: Graph, max_tokens: int) -> int:
    """The executor's buffers (``ir.planner``: rows x slot widths in fp32) and its int8
    activation scratch, at ``max_tokens`` rows."""
    from dynalm.ir.planner import plan_buffers

    widths = plan_buffers(graph).slot_widths
    widest = max(
        (n.args[0].type.row_width for n in graph.nodes if OPS[n.op].kernel == "matmul"),
        default=0,
    )
    scratch = max_tokens * widest * (1 + 12 / 32)  # int8 quants + 3 fp32 per 32-block
    # the experts' gathered rows and their products, a row per (token, slot) (core.experts):
    # at most fp32 rows and products (exact), or products and two int8 quantisations (auto:
    # the source rows' and the gathered rows', ``GroupedMatmul.gather``)
    experts = max(
        (
            n.args[1].type.row_width // 2 * (4 * (rows + cols) + cols * (1 + 36 / 32))
            for n in graph.nodes
            if n.op == "expert_matmul"
            for _, rows, cols in [n.weights[0].type.shape]
        ),
        default=0,
    )
    return int(max_tokens * (4 * sum(widths) + experts) + scratch)


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # where the figure comes from, for messages


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_dirs() -> list[tuple[str, str, str]]:
    """``(limit file, usage file, name)`` of this process's memory cgroup: v2 and v1, each
    at the path /proc/self/cgroup names and at the mount's root (inside a container the
    mount is usually the container's own cgroup, and the named path the host's)."""
    paths = {"v2": [""], "v1": [""]}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                paths["v2"].insert(0, path.rstrip("/"))
            elif "memory" in controllers.split(","):
                paths["v1"].insert(0, path.rstrip("/"))
    except (OSError, ValueError):
        pass
    out = []
    for path in dict.fromkeys(paths["v2"]):
        d = f"/sys/fs/cgroup{path}"
        out.append((f"{d}/memory.max", f"{d}/memory.current", "cgroup v2 memory.max"))
    for path in dict.fromkeys(paths["v1"]):
        d = f"/sys/fs/cgroup/memory{path}"
        out.append(
            (f"{d}/memory.limit_in_bytes", f"{d}/memory.usage_in_bytes", "cgroup v1 memory limit")
        )
    return out


def available_memory() -> Available:
    """What this process may still allocate: the smaller of its cgroup's room (v2
    ``memory.max - memory.current``, or v1 ``limit_in_bytes - usage_in_bytes``) and the
    kernel's MemAvailable."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(Available(int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    for limit_file, usage_file, name in _cgroup_dirs():
        limit = _read_int(limit_file)
        if limit is None:
            continue
        if limit < 1 << 60:  # "max" / a huge number: no limit here
            usage = _read_int(usage_file) or 0
            candidates.append(Available(max(0, limit - usage), name))
        break  # the first readable one is this process's
    if not candidates:  # not Linux: physical memory
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Available(total, "physical memory")
    return min(candidates, key=lambda a: a.bytes)


def library_rss() -> int:
    """Bytes of shared libraries' files mapped resident in this process. They are page cache
    (clean, reclaimable: MemAvailable counts them), and how many of them a run maps depends
    on the page cache itself (a freshly installed .so sits in large folios, mapped 2 MB at a
    time: 60 MB more for the same run), so the plan and the RSS it is held to leave them out."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
                    inside = len(fields) > 5 and ".so" in fields[5].rsplit("/", 1)[-1]
                elif inside and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
    except OSError:
        pass
    return total


def _status_bytes(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss() -> int:
    """This process's resident set now, less its libraries' pages (part of the plan's
    runtime is already in it)."""
    return max(0, _status_bytes("VmRSS:") - library_rss())


def peak_rss() -> int:
    """This process's peak resident set (Linux VmHWM: getrusage's maxrss would also count a
    parent's resident set at fork, which survives exec), less its libraries' pages."""
    return max(0, _status_bytes("VmHWM:") - library_rss())


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv: int
    kv_tokens: int
    activations: int
    runtime: int
    ctx: int
    max_num_seqs: int
    max_tokens: int
    kv_dtype: str
    mode: str
    available: Available
    resident: int  # of the runtime, already held by this process when planned
    advice: str = ""  # when it does not fit: the flags that would make it

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.runtime

    @property
    def device_bytes(self) -> int:
        """What a GPU device would hold: weights, the KV pool and the activations."""
        return self.weights + self.kv + self.activations

    @property
    def need(self) -> int:
        """What is still to be allocated."""
        return max(0, self.total - self.resident)

    @property
    def fits(self) -> bool:
        return self.need <= self.available.bytes

    def line(self) -> str:
        return (
            f"memory plan {mib(self.total)} = weights {mib(self.weights)} + KV "
            f"{mib(self.kv)} ({self.kv_tokens} tokens {self.kv_dtype}: --ctx {self.ctx} x "
            f"--max-num-seqs {self.max_num_seqs}) + activations {mib(self.activations)} "
            f"({self.max_tokens} tokens a step) + runtime {mib(self.runtime)}; available "
            f"{mib(self.available.bytes + self.resident)} ({self.available.source})"
        )

    def describe(self) -> str:
        rows = [
            ("weights", self.weights, f"as repacked for --mode {self.mode}"),
            ("KV pool", self.kv, f"{self.kv_tokens} tokens of {self.kv_dtype}: --ctx "
             f"{self.ctx}, --max-num-seqs {self.max_num_seqs}"),
            ("activations", self.activations, f"{self.max_tokens} tokens a step"),
            ("runtime", self.runtime, "interpreter, libraries, tokenizer"),
            ("total", self.total, ""),
            ("available", self.available.bytes + self.resident, self.available.source),
        ]  # fmt: skip
        lines = [f"  {k:<12}{mib(v):>10}  {why}".rstrip() for k, v, why in rows]
        verdict = "fits" if self.fits else "does NOT fit"
        return "memory plan (" + verdict + "):\n" + "\n".join(lines)

    def check(self) -> MemoryPlan:
        """``self``, or NotEnoughMemory naming the numbers and the flag that would help."""
        if self.fits:
            return self
        short = self.need - self.available.bytes
        raise NotEnoughMemory(
            f"not enough memory: {self.line()}; short by {mib(short)}; {self.advice}"
        )


def _advice(hp: HParams, config: EngineConfig, kv: int, short: int, mode: str) -> str:
    """The flags that would make a plan ``short`` bytes over fit, each found by planning
    the KV pool again with it: the longest --ctx, the most --max-num-seqs, q8_0."""
    budget = kv - short

    def fits(**change: object) -> bool:
        try:
            return kv_pool_size(hp, replace(config, **change))[1] <= budget
        except DynaError:  # e.g. --kv-cache-memory no longer holds one context
            return False

    options = []
    lo, hi = 1, config.ctx // config.page_size  # whole pages: the largest ctx that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if fits(ctx=mid * config.page_size) else (lo, mid)
    if lo > 1 or fits(ctx=config.page_size):
        best = (lo if fits(ctx=lo * config.page_size) else lo - 1) * config.page_size
        if best >= 2:
            options.append(f"--ctx {best}")
    seqs = next((n for n in range(config.max_num_seqs - 1, 0, -1) if fits(max_num_seqs=n)), 0)
    if seqs:
        options.append(f"--max-num-seqs {seqs}")
    smallest = min(KV_FORMATS.values(), key=lambda f: f.value_bytes).name
    if config.kv_cache_dtype != smallest and fits(kv_cache_dtype=smallest):
        options.append(f"--kv-cache-dtype {smallest}")
    if options:
        return "try " + " or ".join(options)
    if mode == "safe":
        return "try --mode auto (safe mode holds every weight in fp32)"
    return "the weights alone do not fit: use a smaller model or quantisation"


def plan_memory(model: LoadedModel, config: EngineConfig, device: Device) -> MemoryPlan:
    """The memory plan of ``model`` run with ``config`` on ``device``."""
    graph, hp, mode = model.graph, model.hparams, device.mode
    weights = weight_bytes(graph, device)
    kv_tokens, kv = kv_pool_size(hp, config)
    runtime = RUNTIME_BYTES + TOKENIZER_BYTES_PER_TOKEN * hp.n_vocab
    plan = MemoryPlan(
        weights=weights,
        kv=kv,
        kv_tokens=kv_tokens,
        activations=activation_bytes(graph, config.max_num_batched_tokens),
        runtime=runtime,
        ctx=config.ctx,
        max_num_seqs=config.max_num_seqs,
        max_tokens=config.max_num_batched_tokens,
        kv_dtype=config.kv_cache_dtype,
        mode=mode,
        available=available_memory(),
        resident=min(current_rss(), runtime),
    )
    if plan.fits:
        return plan
    short = plan.need - plan.available.bytes
    return replace(plan, advice=_advice(hp, config, kv, short, mode))
