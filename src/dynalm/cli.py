"""The ``dynalm`` command line: pull · run · serve · ps · stop · list · show · rm · bench ·
perplexity.

stdout carries only what a command produces (the generated text for ``run``), so
it can be piped; banners, statistics and errors go to stderr. A user error is
one line, ``error: ...``, and a non-zero exit; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from dynalm.core import weight_pages
from dynalm.core.kv_formats import KV_FORMATS
from dynalm.flags import MAX_TOKENS, Duration, Float, Int, Size
from dynalm.runtime.engine.config import MAX_DRAFT_TOKENS
from dynalm.runtime.serve.routing import POLICIES

if TYPE_CHECKING:
    from dynalm.models.loader import LoadedModel
    from dynalm.runtime.engine.build import EngineSpec
    from dynalm.runtime.engine.config import EngineConfig
    from dynalm.runtime.engine.guided import Guide
    from dynalm.runtime.engine.sampling import SamplingParams
    from dynalm.runtime.generator import Generator
    from dynalm.runtime.serve.models import ModelManager, ServedModel

err = Console(stderr=True, highlight=False, soft_wrap=True)
MAX_ERROR_CHARS = 1000  # an error line never runs longer, whatever value it quotes
DEFAULT_CTX = 4096
# The ranges of the numeric flags (each also parsed by dynalm.flags: ASCII digits only).
MAX_NUM_SEQS = 4096  # seats of the running batch (each holds buffers of its own)
MAX_QUEUE = 1_000_000
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def print_error(message: str) -> None:
    """``error: message`` on stderr, on one line of bounded length."""
    line = " ".join(message.split())
    if len(line) > MAX_ERROR_CHARS:
        line = line[: MAX_ERROR_CHARS - 30] + f"... ({len(line)} characters)"
    err.print(f"[red]error:[/] {escape(line)}")


class _Commands(TyperGroup):
    """Usage errors (a bad option value, a missing argument) as one ``error:`` line like
    every other error, instead of a framed panel; exit status 2 as click's. (No arguments
    at all still prints the help.)"""

    def main(self, args: list[str] | None = None, **kwargs: object) -> None:  # type: ignore[override]
        args = sys.argv[1:] if args is None else args
        if not args:
            return super().main(args, **kwargs)
        try:
            code = super().main(args, **{**kwargs, "standalone_mode": False})
        except typer.TyperException as e:
            print_error(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="DynaLM: run LLMs on your own machine.",
)


class Mode(str, Enum):
    auto = "auto"
    exact = "exact"
    safe = "safe"


class Backend(str, Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


# `serve --router`: routing.POLICIES's names (that module imports nothing heavy)
Router = Enum("Router", {p.replace("-", "_"): p for p in POLICIES}, type=str)  # type: ignore[misc]


@contextmanager
def user_errors(verbose: bool) -> Iterator[None]:
    """Turn failures into one line on stderr (the traceback too with --verbose): exit status
    1 for an error the user can fix (``DynaError``, a file that cannot be read or written,
    memory), 2 for an internal error, which is a bug to report."""
    from dynalm.errors import DynaError

    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):  # usage errors: _Commands
        raise
    except Exception as e:
        if verbose:
            err.print_exception()
        if isinstance(e, DynaError):
            print_error(str(e))
        elif isinstance(e, MemoryError):
            print_error("out of memory (try a smaller --ctx, --kv-cache-memory or model)")
        elif isinstance(e, OSError):
            where = f"{e.filename}: " if e.filename else ""
            print_error(f"{where}{e.strerror or e}")
        else:
            print_error(
                f"internal error ({type(e).__name__}: {e}); please report it with the "
                "output of --verbose"
            )
            raise typer.Exit(2) from None
        raise typer.Exit(1) from None


def _configure(
    verbose: bool,
    threads: int | None,
    pages: WeightPagesChoice | None = None,
    default_pages: str | None = None,
) -> None:
    """Logging, BLAS threads, and where weights lie: ``pages`` (--weight-pages) over
    $DYNALM_WEIGHT_PAGES over the command's ``default_pages`` (through the environment, so
    the processes it starts place theirs alike)."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr
    )
    if threads:  # must happen before numpy loads its BLAS (the device refuses too many)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(min(threads, os.cpu_count() or 1))
    if pages is not None:
        os.environ[weight_pages.VARIABLE] = pages.value
    elif default_pages is not None:
        os.environ.setdefault(weight_pages.VARIABLE, default_pages)


def _utf8(text: str, what: str) -> str:
    """``text`` from the command line, refused if it is not valid UTF-8 (Python keeps such
    bytes of argv as lone surrogates, which no tokenizer takes)."""
    from dynalm.errors import InvalidRequest

    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid UTF-8 text (at character {e.start})") from None
    return text


def _context(ctx: int | None, model: LoadedModel) -> int:
    """--ctx checked against the model's trained context; by default the smaller of 4096
    and the trained context. (Whether its KV cache fits is the memory plan's question.)"""
    from dynalm.errors import InvalidRequest

    hp = model.hparams
    if ctx is None:
        return min(DEFAULT_CTX, hp.n_ctx_train)
    if ctx > hp.n_ctx_train:
        raise InvalidRequest(
            f"--ctx {ctx} is more than the {hp.n_ctx_train} tokens {model.name} was trained "
            f"for ({hp.arch}.context_length)"
        )
    return ctx


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Timings and tracebacks on stderr.")]
Threads = Annotated[
    int | None,
    typer.Option(
        "-t", "--threads", parser=Int(1, 1024), help="CPU threads (default: physical cores)."
    ),
]
Ctx = Annotated[
    int | None,
    typer.Option(
        parser=Int(2, MAX_TOKENS),
        help="Context window per request, in tokens (default: 4096, at most "
        "the model's trained context).",
    ),
]
ModeOption = Annotated[Mode, typer.Option(help="auto | exact | safe")]
BackendOption = Annotated[Backend, typer.Option(help="auto | cpu | gpu")]
CpuFlag = Annotated[bool, typer.Option("--cpu", help="Same as --backend cpu.")]
GpuFlag = Annotated[bool, typer.Option("--gpu", help="Same as --backend gpu.")]


class Pooling(str, Enum):
    mean = "mean"
    cls = "cls"
    last = "last"


POOLING_TYPES = {Pooling.mean: 1, Pooling.cls: 2, Pooling.last: 3}  # llama.cpp's numbers
PoolingOption = Annotated[
    Pooling | None,
    typer.Option(
        help="Embed with this pooling (mean | cls | last), whatever the file says: a "
        "generation model becomes an embedding model (last: Qwen3-Embedding's; vLLM's "
        "--task embed).",
    ),
]


def _pooling(pooling: Pooling | None) -> int | None:
    return None if pooling is None else POOLING_TYPES[pooling]


KVCacheDtype = Enum("KVCacheDtype", {name: name for name in KV_FORMATS}, type=str)  # type: ignore[misc]


WeightPagesChoice = Enum("WeightPagesChoice", {n: n for n in weight_pages.CHOICES}, type=str)  # type: ignore[misc]


def _weight_pages(default: str) -> Any:
    """The --weight-pages option of a command whose default is ``default``."""
    return Annotated[
        WeightPagesChoice | None,
        typer.Option(
            help="Where the weights lie: huge (copied onto 2 MiB pages, which decode streams "
            "faster) or mapped (the repack cache's files mapped: a faster load and first "
            f"answer). Default: $DYNALM_WEIGHT_PAGES, else {default}.",
        ),
    ]


# A one-off answer does not repay copying the weights (1B: 40 tokens 2.6 s mapped against
# 2.9-4.0 huge, 400 tokens 12.1-12.3 against 12.0); a server and a benchmark run long. A
# server's replicas are processes of their own: on huge pages each would hold a copy of the
# weights, where mapped ones share the page cache's.
RunWeightPages, BenchWeightPages = _weight_pages("mapped"), _weight_pages("huge")
ServeWeightPages = _weight_pages("huge (with --replicas: mapped, shared by the replicas)")


KVDtype = Annotated[
    KVCacheDtype,
    typer.Option(
        help=f"KV cache dtype: {' | '.join(KV_FORMATS)} (q8_0: half of f16's bytes per token; "
        "each running sequence's last 32 tokens also kept in f16, for accuracy)"
    ),
]


Draft = Annotated[
    str | None,
    typer.Option(
        help="Speculative decoding with this draft model (catalog name or GGUF path): "
        "smaller, with the target's vocabulary, e.g. SmolLM2 135M for SmolLM2 1.7B."
    ),
]
Speculative = Annotated[
    str | None,
    typer.Option(
        help="Speculative decoding without a draft model: ngram (prompt lookup: drafts what "
        "followed the last tokens earlier in the text) | layer-skip (the model with some "
        "layers skipped)."
    ),
]
NumDraftTokens = Annotated[
    int,
    typer.Option(
        parser=Int(1, MAX_DRAFT_TOKENS),
        help="Most draft tokens per step (1-16; fewer where drafts miss).",
    ),
]
MaxNumSeqs = Int(1, MAX_NUM_SEQS)


def _engine_spec(
    model: LoadedModel,
    config: EngineConfig,
    backend: Backend,
    cpu: bool,
    gpu: bool,
    mode: Mode,
    threads: int | None,
    draft: str | None = None,
    speculative: str | None = None,
) -> EngineSpec:
    """The engine these flags ask for, as ``build_engine`` takes it (a server plans it
    before it builds it): on the device --backend/--cpu/--gpu, --mode and --threads choose
    (a GPU only if it runs and holds ``model`` with ``config``), with the drafter --draft (a
    model of the store, loaded here) or --speculative asks for. --verbose logs its memory
    plan."""
    from dynalm.models.loader import load_model
    from dynalm.runtime.engine.build import EngineSpec
    from dynalm.runtime.engine.config import check_num_draft_tokens
    from dynalm.store.catalog import ModelStore

    check_num_draft_tokens(config.num_draft_tokens)  # before loading a draft model
    draft_model = None if draft is None else load_model(ModelStore().resolve(draft))
    backend_name = _backend(backend, cpu, gpu)
    return EngineSpec(model, config, backend_name, mode.value, threads, draft_model, speculative)


@dataclass(frozen=True)
class _Prepared:
    """A model `serve` is about to load (``ModelManager``'s `PreparedModel`)."""

    size_bytes: int
    loader: Callable[[], ServedModel]
    # a generation model's, for a cluster's ingress (which tokenizes but runs no engine)
    model: Any = None
    config: Any = None
    names: tuple[str, ...] = ()

    def load(self) -> ServedModel:
        return self.loader()


def _backend(backend: Backend, cpu: bool, gpu: bool) -> str:
    """--backend, or what --cpu / --gpu say instead."""
    if cpu and gpu:
        raise typer.BadParameter("--cpu and --gpu exclude each other")
    return "gpu" if gpu else "cpu" if cpu else backend.value


@app.command()
def pull(
    model: Annotated[
        str,
        typer.Argument(
            help="Catalog name (smollm2:135m) or Hugging Face repo: [hf.co/]ORG/REPO[:TAG][@REV]"
        ),
    ],
    verbose: Verbose = False,
) -> None:
    """Download a model into the store (idempotent, verified by sha256)."""
    _configure(verbose, None)
    from dynalm.store.commands import pull_command

    with user_errors(verbose):
        pull_command(model)


@app.command("list")
def list_models(
    catalog: Annotated[
        bool, typer.Option("--catalog", help="List the catalog's models instead.")
    ] = False,
    verbose: Verbose = False,
) -> None:
    """List the models in the store (or in the catalog)."""
    from dynalm.store.commands import list_command

    with user_errors(verbose):
        list_command(catalog=catalog)


@app.command()
def rm(model: str, verbose: Verbose = False) -> None:
    """Delete a model from the store."""
    from dynalm.store.commands import rm_command

    with user_errors(verbose):
        rm_command(model)


@app.command()
def show(
    model: Annotated[str | None, typer.Argument(help="Model name or GGUF path")] = None,
    graph: Annotated[bool, typer.Option("--graph", help="Print the DynaIR graph.")] = False,
    graph_file: Annotated[
        Path | None,
        typer.Option("--graph-file", help="Read a DynaIR text file, check it, print it."),
    ] = None,
    system: Annotated[bool, typer.Option("--system", help="Describe this machine.")] = False,
    ctx: Ctx = None,
    max_num_seqs: Annotated[
        int, typer.Option(parser=MaxNumSeqs, help="Sequences the memory plan holds KV for.")
    ] = 16,
    kv_cache_dtype: KVDtype = KVCacheDtype.f16,
    mode: ModeOption = Mode.auto,
    verbose: Verbose = False,
) -> None:
    """Describe a model (architecture, size, quant types, template, and the memory plan at
    --ctx / --max-num-seqs / --kv-cache-dtype / --mode) or the system."""
    _configure(verbose, None)
    with user_errors(verbose):
        if system:
            from dynalm.show import describe_system

            typer.echo(describe_system())
            return
        if graph_file is not None:
            from dynalm.files import read_source
            from dynalm.ir.text import MAX_FILE_BYTES, print_graph, read_graph

            text = read_source(graph_file, MAX_FILE_BYTES)
            typer.echo(print_graph(read_graph(text, str(graph_file))))
            return
        if model is None:
            raise typer.BadParameter("give a MODEL, --graph-file or --system")
        from dynalm.core.cpu_device import CpuDevice
        from dynalm.models.loader import load_model
        from dynalm.runtime.engine.config import EngineConfig
        from dynalm.runtime.engine.memory_plan import plan_memory
        from dynalm.show import describe_model
        from dynalm.store.catalog import ModelStore

        loaded = load_model(ModelStore().resolve(model))
        if graph:
            from dynalm.ir.text import print_graph

            typer.echo(print_graph(loaded.graph))
            return
        config = EngineConfig(
            ctx=_context(ctx, loaded),
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype.value,
        )
        plan = plan_memory(loaded, config, CpuDevice(mode.value, threads=1))
        typer.echo(describe_model(loaded, plan))


@app.command()
def check(
    file: Annotated[Path, typer.Argument(help="A Lumen (.lum) architecture file")],
    gguf: Annotated[
        Path | None,
        typer.Option("--gguf", help="Also elaborate it against this model's metadata and tensors."),
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Parse and type-check a .lum file (errors as file:line:col)."""
    _configure(verbose, None)
    with user_errors(verbose):
        from dynalm.models.arch import check_file

        typer.echo(check_file(file, gguf))


def _read_prompt(prompt: str | None) -> str | None:
    """The prompt argument, or stdin for '-' (or no prompt and no terminal)."""
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        from dynalm.errors import InvalidRequest

        data = sys.stdin.buffer.read()
        try:
            return data.decode()
        except UnicodeDecodeError as e:
            raise InvalidRequest(
                f"stdin is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
            ) from None
    return prompt


def _stream(
    generator: Generator,
    prompt_ids: list[int],
    params: SamplingParams,
    guide: Guide | None = None,
    channels: bool = False,
) -> str:
    """Write the answer to stdout as it is generated; returns it. A harmony answer (gpt-oss:
    ``channels`` true) is read by its channels: the reasoning dimmed on stderr, the rest on
    stdout (and returned)."""
    from dynalm.runtime.serve.harmony import HarmonyReader, HarmonyText

    pieces = []
    text, reader = HarmonyText(generator.model.tokenizer), HarmonyReader()

    def show(parts: list) -> None:
        for part in parts:
            if part.kind == "reasoning":
                err.print(f"[dim]{escape(part.text)}[/]", end="")
                continue
            body = part.text if part.kind == "content" else f"to={part.recipient} {part.text}"
            pieces.append(body)
            sys.stdout.write(body)
            sys.stdout.flush()

    for event in generator.generate(prompt_ids, params, guide=guide):
        if channels:
            show(reader.push(text.push([] if event.token is None else [event.token])))
        elif event.text:
            pieces.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if channels:
        show(reader.push(text.flush()) + reader.finish())
    return "".join(pieces)


def _schema_guide(generator: Generator, path: Path) -> Guide:
    """The grammar of the JSON schema in file ``path`` (--json-schema)."""
    from dynalm.errors import InvalidRequest
    from dynalm.runtime.serve.structured import json_grammar, load_schema

    what = f"--json-schema {path}"
    try:
        text = path.read_bytes()
    except OSError as e:
        raise InvalidRequest(f"{what}: cannot read a JSON schema: {e}") from None
    schema = load_schema(text, what)
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{what}: a JSON schema is an object")
    return generator.engine.grammars.compile(json_grammar(schema, what), what)


def _chat(
    generator: Generator,
    params: SamplingParams,
    system: str | None,
    verbose: bool,
    guide: Guide | None = None,
) -> None:
    """Interactive multi-turn chat: /bye or Ctrl-D exits; Ctrl-C stops the answer."""
    from dynalm.models.chat_template import harmony

    model = generator.model
    messages = [{"role": "system", "content": system}] if system else []
    err.print("[dim]Chat with the model. /bye or Ctrl-D to exit, Ctrl-C stops an answer.[/]")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            err.print()
            return
        except KeyboardInterrupt:
            err.print("\n[dim]Use Ctrl-D or /bye to exit.[/]")
            continue
        except UnicodeDecodeError:
            err.print("[dim]That line was not UTF-8 text; type it again.[/]")
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = model.tokenizer.encode(model.chat_template.render(messages), add_special=False)
        try:
            answer = _stream(generator, ids, params, guide, harmony(model.chat_template.source))
        except KeyboardInterrupt:
            answer = ""
            err.print("\n[dim](stopped)[/]")
        sys.stdout.write("\n\n")
        messages.append({"role": "assistant", "content": answer})
        if verbose:
            err.print(f"[dim]{generator.stats.summary()}[/]")
            if generator.engine.planner is not None:
                err.print(f"[dim]{generator.engine.spec_stats.summary()}[/]")


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="Catalog name (smollm2:135m) or GGUF path")],
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt; '-' reads stdin; none starts an interactive chat"),
    ] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, no template.")] = False,
    max_tokens: Annotated[
        int, typer.Option(parser=Int(0, MAX_TOKENS), help="Most tokens to generate.")
    ] = 512,
    temperature: Annotated[float, typer.Option(parser=Float(0, 100), help="0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(parser=Int(0, 2**31 - 1), help="0 = off.")] = 40,
    top_p: Annotated[float, typer.Option(parser=Float(0, 1), help="1 = off.")] = 0.9,
    min_p: Annotated[float, typer.Option(parser=Float(0, 1), help="0 = off.")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option(parser=Float(0, 100), help="1 = off.")] = 1.1,
    seed: Annotated[
        int | None, typer.Option(parser=Int(0, 2**64 - 1), help="Same seed, same output.")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    json_schema: Annotated[
        Path | None, typer.Option(help="Answer as JSON valid against this JSON schema file.")
    ] = None,
    ctx: Ctx = None,
    kv_cache_dtype: KVDtype = KVCacheDtype.f16,
    draft: Draft = None,
    speculative: Speculative = None,
    num_draft_tokens: NumDraftTokens = 4,
    threads: Threads = None,
    mode: ModeOption = Mode.auto,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    weight_pages: RunWeightPages = None,
    verbose: Verbose = False,
) -> None:
    """Generate from a prompt (streamed to stdout), or chat interactively."""
    _configure(verbose, threads, weight_pages, "mapped")
    with user_errors(verbose):
        import time

        from dynalm.models.chat_template import harmony
        from dynalm.models.loader import load_model
        from dynalm.runtime.engine.sampling import SamplingParams
        from dynalm.runtime.generator import Generator, generator_config
        from dynalm.store.catalog import ModelStore

        for text, what in [(prompt, "the prompt"), (system, "--system")] + [
            (s, "--stop") for s in stop or []
        ]:
            if text is not None:
                _utf8(text, what)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            stop=list(stop or []),
        ).validate()
        t0 = time.perf_counter()
        loaded = load_model(ModelStore().resolve(model))
        t1 = time.perf_counter()
        config = generator_config(_context(ctx, loaded), kv_cache_dtype.value, num_draft_tokens)
        from dynalm.runtime.engine.build import build_engine

        engine = build_engine(
            _engine_spec(loaded, config, backend, cpu, gpu, mode, threads, draft, speculative)
        )
        generator, device = Generator(engine), engine.device
        if verbose:  # binding repacks the weights once; the rest is kernels and buffers
            err.print(
                f"[dim]loaded {loaded.name} on {device.describe()}: file {t1 - t0:.2f} s, "
                f"bind {time.perf_counter() - t1:.2f} s (weight repack "
                f"{device.repack_seconds:.2f} s, {device.mapped} of "
                f"{device.mapped + device.repacked} weights from the repack cache)[/]"
            )
        guide = None if json_schema is None else _schema_guide(generator, json_schema)
        text = _read_prompt(prompt)
        if text is None:
            _chat(generator, params, system, verbose, guide)
            return
        if raw:
            ids = loaded.tokenizer.encode(text, add_special=True)
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            ids = loaded.tokenizer.encode(loaded.chat_template.render(messages), add_special=False)
        try:
            channels = not raw and harmony(loaded.chat_template.source)
            answer = _stream(generator, ids, params, guide, channels)
        except KeyboardInterrupt:
            answer = ""
            err.print("\n[dim](stopped)[/]")
        if not answer.endswith("\n"):
            sys.stdout.write("\n")
        if verbose:
            err.print(f"[dim]{generator.stats.summary()}[/]")
            if engine.planner is not None:
                err.print(f"[dim]{engine.spec_stats.summary()}[/]")


@app.command()
def serve(
    models: Annotated[
        list[str] | None,
        typer.Argument(
            help="Catalog names (smollm2:135m) or GGUF paths to serve; none: every model in "
            "the store. Each loads on its first request (those named here at start, while "
            "they fit) and unloads after --keep-alive idle.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 exposes it).")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(parser=Int(0, 65535), help="TCP port (0 picks a free one).")
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="DYNALM_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    ] = None,
    ctx: Ctx = None,
    max_num_seqs: Annotated[
        int, typer.Option(parser=MaxNumSeqs, help="Most requests in one batch.")
    ] = 16,
    max_num_batched_tokens: Annotated[
        int,
        typer.Option(
            parser=Int(1, MAX_TOKENS), help="Token budget of a step (an embedding model's too)."
        ),
    ] = 512,
    max_queue: Annotated[
        int,
        typer.Option(
            parser=Int(1, MAX_QUEUE),
            help="Waiting requests beyond which: 503 (a model's; an embedding model's too).",
        ),
    ] = 256,
    kv_cache_memory: Annotated[
        int | None,
        typer.Option(
            parser=Size(KIB, TIB),
            help="KV pool size, e.g. 512MiB (default: the engine's); the memory plan checks "
            "that it fits.",
        ),
    ] = None,
    kv_cache_dtype: KVDtype = KVCacheDtype.f16,
    draft: Draft = None,
    speculative: Speculative = None,
    num_draft_tokens: NumDraftTokens = 4,
    max_body_size: Annotated[
        int,
        typer.Option(parser=Size(KIB, GIB), help="Largest request body, e.g. 8MiB (beyond: 413)."),
    ] = "8MiB",  # type: ignore[assignment]  # click parses the default as it parses a flag
    shutdown_grace: Annotated[
        float,
        typer.Option(
            parser=Float(0, 3600),
            help="Seconds in-flight requests get after SIGTERM, then aborted.",
        ),
    ] = 30.0,
    keep_alive: Annotated[
        float,
        typer.Option(
            parser=Duration(),
            help="How long a model stays loaded after its last request: 10m, 30s, 1h, "
            "seconds; 0 unloads at once, -1 never (a request's keep_alive overrides it).",
        ),
    ] = "5m",  # type: ignore[assignment]  # click parses the default as it parses a flag
    max_loaded: Annotated[
        int | None,
        typer.Option(
            parser=Int(1, 1000),
            help="Most models loaded at once (the least recently used idle one makes room).",
        ),
    ] = None,
    max_memory: Annotated[
        int | None,
        typer.Option(
            parser=Size(16 * MIB, 64 * TIB),
            help="Memory the loaded models' plans may take together, e.g. 8GiB (default: "
            "the memory available at start less 10%, at least 512MiB).",
        ),
    ] = None,
    pooling: PoolingOption = None,
    threads: Threads = None,
    mode: ModeOption = Mode.auto,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    replicas: Annotated[
        int | None,
        typer.Option(
            parser=Int(1, 1024),
            help="Serve the model from N engines on a Ray cluster behind this one endpoint "
            "(needs dynalm[cluster]); each replica gets --threads CPUs (default 1).",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --replicas: an existing Ray cluster (ray://head:10001); "
            "default: a local one on 127.0.0.1."
        ),
    ] = None,
    router: Annotated[
        Router,
        typer.Option(
            help="With --replicas: which replica a request goes to. prefix: the one that was "
            "sent the longest prefix of its prompt, unless loads are imbalanced (a prefix "
            "with more than its holders' share of the traffic gets one more); pow2: the "
            "less loaded of two at random; round-robin: each in turn."
        ),
    ] = Router.prefix,  # type: ignore[attr-defined]
    weight_pages: ServeWeightPages = None,
    verbose: Verbose = False,
) -> None:
    """Serve models over an OpenAI-compatible HTTP API until SIGTERM / Ctrl-C: loaded on
    demand, unloaded when idle, as Ollama's server."""
    if replicas is not None and threads is None:
        threads = 1  # a replica's engine threads = its actor's CPUs
    _configure(verbose, threads, weight_pages, "huge" if replicas is None else "mapped")
    with user_errors(verbose):
        from dynalm.models.loader import load_model
        from dynalm.runtime.embed import (
            Embedder,
            Reranker,
            is_embedding_model,
            is_reranker,
            scratch_bytes,
        )
        from dynalm.runtime.engine.build import build_engine, plan_engine
        from dynalm.runtime.engine.config import EngineConfig
        from dynalm.runtime.engine.memory_plan import available_memory
        from dynalm.runtime.serve import server
        from dynalm.runtime.serve.embeddings import EmbeddingService
        from dynalm.runtime.serve.models import ModelManager, ModelService
        from dynalm.runtime.serve.rerank import RerankService
        from dynalm.store.catalog import ModelStore, is_local_path

        store = ModelStore()
        # clients name a model as it was given here; a path by its file's stem
        given = {Path(m).stem if is_local_path(m) else m: m for m in models or []}

        def prepare(name: str) -> _Prepared:
            path = store.resolve(given.get(name, name), pull=name in given)
            loaded = load_model(path, _pooling(pooling))
            names = [name] if path.stem == name else [name, path.stem]
            if is_embedding_model(loaded) or is_reranker(loaded):  # no engine
                # its size: its weights as mapped and a decoder's scratch KV pool (its step
                # buffers are small beside them)
                files = [path] if path.is_file() else list(path.glob("*.safetensors"))
                size = sum(f.stat().st_size for f in files)
                size += scratch_bytes(loaded, max_num_batched_tokens)
                # /v1/embeddings, or /v1/rerank for a cross-encoder
                rerank = is_reranker(loaded)
                kind, service = (
                    (Reranker, RerankService) if rerank else (Embedder, EmbeddingService)
                )
                return _Prepared(size, lambda: service(
                    kind(loaded, backend=_backend(backend, cpu, gpu), mode=mode.value,
                         threads=threads, max_tokens=max_num_batched_tokens,
                         max_queue=max_queue, beside=manager),
                    names,
                    size,
                ))  # fmt: skip
            config = EngineConfig(
                ctx=_context(ctx, loaded),
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_queue=max_queue,
                kv_cache_memory=kv_cache_memory,
                kv_cache_dtype=kv_cache_dtype.value,
                num_draft_tokens=num_draft_tokens,
            )
            spec = _engine_spec(
                loaded, config, backend, cpu, gpu, mode, threads, draft, speculative
            )
            device, plan = plan_engine(spec)
            plan.check()  # beyond this machine, whatever the budget says
            return _Prepared(plan.device_bytes, lambda: ModelService(
                build_engine(replace(spec, device=device)), loaded, names
            ), loaded, config, tuple(names))  # fmt: skip

        def serving(manager: ModelManager) -> None:
            server.serve(
                manager,
                host=host,
                port=port,
                api_key=api_key,
                verbose=verbose,
                max_body_bytes=max_body_size,
                shutdown_grace_s=shutdown_grace,
            )

        if replicas is not None:
            with _cluster(prepare, list(given), replicas, ray_address, router.value, threads) as m:
                serving(m)
            return

        if max_memory is None:
            free = available_memory().bytes
            max_memory = max(0, free - max(512 * MIB, free // 10))
        manager = ModelManager(
            prepare,
            list(given) or None,
            catalog=lambda: [m.name for m in store.list()],
            keep_alive=keep_alive,
            max_memory=max_memory,
            max_loaded=max_loaded,
        )
        left = manager.preload(list(given))
        if left:
            err.print(f"[dim]not loaded at start (loaded on demand): {', '.join(left)}[/]")
        serving(manager)


@contextmanager
def _cluster(
    prepare: Callable[[str], _Prepared],
    names: list[str],
    replicas: int,
    address: str | None,
    router: str,
    threads: int | None,
) -> Iterator[ModelManager]:
    """`serve --replicas`: one model's engines on Ray Serve; the manager of this process's
    endpoint for them. Ray Serve and Ray (a local cluster) are stopped after."""
    from dynalm.runtime.engine.memory_plan import kv_pool_size
    from dynalm.runtime.serve import cluster
    from dynalm.runtime.serve.models import ModelManager

    if len(names) != 1:
        raise typer.BadParameter("--replicas serves exactly one model: name it")
    cpus = threads or 1
    cluster.connect(address, cpus * replicas)  # first: a bad address fails before any load
    try:
        front = prepare(names[0])  # pulls it into this node's store before any replica starts
        if front.model is None:
            raise typer.BadParameter("--replicas serves generation models, not embedding models")
        tree = kv_pool_size(front.model.hparams, front.config)[0]  # a replica's KV tokens
        handle = cluster.deploy(prepare, names[0], replicas, cpus, router, tree)
        service = cluster.ClusterModelService(front.model, front.config, front.names, handle)
        yield ModelManager.of([service])
    finally:
        cluster.shutdown()


ServerHost = Annotated[
    str | None,
    typer.Option(
        "--host",
        help="The server: host, host:port or a URL (default: DYNALM_HOST, else 127.0.0.1).",
    ),
]
ServerPort = Annotated[
    int | None, typer.Option(parser=Int(1, 65535), help="Its port (default 8000).")
]


@app.command()
def ps(host: ServerHost = None, port: ServerPort = None, verbose: Verbose = False) -> None:
    """The models a running server has loaded: name, size, device, until when."""
    from dynalm.runtime.serve.remote import ps_command, server_url

    with user_errors(verbose):
        ps_command(server_url(host, port))


@app.command()
def stop(
    model: Annotated[str, typer.Argument(help="The loaded model to unload")],
    host: ServerHost = None,
    port: ServerPort = None,
    verbose: Verbose = False,
) -> None:
    """Unload a model from a running server now (once the requests using it have ended)."""
    from dynalm.runtime.serve.remote import server_url, stop_command

    with user_errors(verbose):
        stop_command(server_url(host, port), model)


@app.command()
def bench(
    model: Annotated[str, typer.Argument(help="Catalog name (smollm2:135m) or GGUF path")],
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="Prompt sizes (pp).")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Decode lengths (tg).")] = "128",
    threads: Threads = None,
    repetitions: Annotated[
        int, typer.Option("-r", "--repetitions", parser=Int(1, 1000), help="Timed runs.")
    ] = 5,
    mode: ModeOption = Mode.auto,
    vs: Annotated[
        str | None,
        typer.Option("--vs", help="llama.cpp: run the same file in llama-cpp-python too."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    profile: Annotated[
        bool, typer.Option("--profile", help="Kernel vs Python time per step of each test.")
    ] = False,
    speculative: Annotated[
        str | None,
        typer.Option(help="Also run with this drafter (ngram | layer-skip): speed-up, acceptance."),
    ] = None,
    num_draft_tokens: NumDraftTokens = 4,
    kv_cache_dtype: KVDtype = KVCacheDtype.f16,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    weight_pages: BenchWeightPages = None,
    verbose: Verbose = False,
) -> None:
    """Measure prefill (pp) and decode (tg) speed, llama-bench style."""
    _configure(verbose, threads, weight_pages, "huge")
    with user_errors(verbose):
        from dynalm.bench import bench_command, parse_tests
        from dynalm.store.catalog import ModelStore

        tests = parse_tests(n_prompt, n_gen)
        typer.echo(
            bench_command(
                ModelStore().resolve(model),
                tests,
                threads=threads,
                repetitions=repetitions,
                mode=mode.value,
                vs=vs,
                backend=_backend(backend, cpu, gpu),
                as_json=json_output,
                profile=profile,
                speculative=speculative,
                num_draft_tokens=num_draft_tokens,
                kv_cache_dtype=kv_cache_dtype.value,
            )
        )


@app.command()
def embed(
    model: Annotated[str, typer.Argument(help="Catalog name or GGUF path of an embedding model")],
    texts: Annotated[list[str], typer.Argument(help="Texts to embed ('-': one per line of stdin)")],
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON object: the vectors and the token counts.")
    ] = False,
    truncate: Annotated[
        bool, typer.Option(help="Cut a text longer than the model's maximum length to it.")
    ] = False,
    pooling: PoolingOption = None,
    threads: Threads = None,
    mode: ModeOption = Mode.auto,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    verbose: Verbose = False,
) -> None:
    """Embed texts with an embedding model (bert, or a decoder with a pooling type, or any
    decoder with --pooling): one L2-normalised vector per text, one line
    each (numbers separated by spaces), in the order given."""
    _configure(verbose, threads)
    with user_errors(verbose):
        import json

        from dynalm.models.loader import load_model
        from dynalm.runtime.embed import Embedder
        from dynalm.store.catalog import ModelStore

        if texts == ["-"]:
            texts = sys.stdin.read().splitlines()
        loaded = load_model(ModelStore().resolve(model), _pooling(pooling))
        embedder = Embedder(
            loaded, backend=_backend(backend, cpu, gpu), mode=mode.value, threads=threads
        )
        ids = [
            embedder.tokenize(_utf8(t, f"text {i + 1}"), i, truncate) for i, t in enumerate(texts)
        ]
        vectors = embedder.embed(ids)
        if json_output:
            tokens = [len(i) for i in ids]
            typer.echo(
                json.dumps({"model": loaded.name, "embeddings": vectors.tolist(), "tokens": tokens})
            )
        else:
            for v in vectors:
                typer.echo(" ".join(f"{x:.7g}" for x in v))


@app.command()
def rerank(
    model: Annotated[str, typer.Argument(help="Catalog name or GGUF path of a reranker")],
    query: Annotated[str, typer.Argument(help="The query the documents are ranked against")],
    documents: Annotated[
        list[str], typer.Argument(help="Documents to rank ('-': one per line of stdin)")
    ],
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON object, as /v1/rerank answers.")
    ] = False,
    truncate: Annotated[
        bool, typer.Option(help="Cut a document whose pair is past the maximum length.")
    ] = False,
    threads: Threads = None,
    mode: ModeOption = Mode.auto,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    verbose: Verbose = False,
) -> None:
    """Rank documents by their relevance to a query with a reranker (a cross-encoder): one
    line per document, best first: its relevance score (the sigmoid of the model's logit,
    as /v1/rerank gives it), its index among the documents given, and its text."""
    _configure(verbose, threads)
    with user_errors(verbose):
        import json

        from dynalm.errors import InvalidRequest
        from dynalm.models.loader import load_model
        from dynalm.runtime.embed import Reranker, relevance
        from dynalm.store.catalog import ModelStore

        if documents == ["-"]:
            documents = sys.stdin.read().splitlines()
        loaded = load_model(ModelStore().resolve(model))
        reranker = Reranker(
            loaded, backend=_backend(backend, cpu, gpu), mode=mode.value, threads=threads
        )
        docs = [_utf8(d, f"document {i + 1}") for i, d in enumerate(documents)]
        if not docs:
            raise InvalidRequest("no documents to rank")
        logits = reranker.score(_utf8(query, "the query"), docs, truncate)
        order = sorted(range(len(docs)), key=lambda i: -float(logits[i]))
        results = [
            {"index": i, "relevance_score": relevance(float(logits[i])), "document": docs[i]}
            for i in order
        ]
        if json_output:
            typer.echo(json.dumps({"model": loaded.name, "results": results}))
        else:
            for r in results:
                typer.echo(f"{r['relevance_score']:.6f}\t{r['index']}\t{r['document']}")


@app.command()
def perplexity(
    model: Annotated[str, typer.Argument(help="Catalog name (smollm2:135m) or GGUF path")],
    text_file: Annotated[str, typer.Argument(help="UTF-8 text file to score ('-': stdin)")],
    ctx: Annotated[
        int,
        typer.Option(
            parser=Int(4, MAX_TOKENS),
            help="Window in tokens; the second half of each is scored.",
        ),
    ] = 512,
    kv_cache_dtype: KVDtype = KVCacheDtype.f16,
    threads: Threads = None,
    mode: ModeOption = Mode.auto,
    backend: BackendOption = Backend.auto,
    cpu: CpuFlag = False,
    gpu: GpuFlag = False,
    verbose: Verbose = False,
) -> None:
    """Perplexity over a text file, as llama-perplexity measures it: PPL +/- its standard
    error, and tokens/s (a progress bar on stderr)."""
    _configure(verbose, threads)
    with user_errors(verbose):
        from pathlib import Path

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        from dynalm.errors import InvalidRequest
        from dynalm.models.loader import load_model
        from dynalm.runtime.engine.config import EngineConfig
        from dynalm.runtime.perplexity import perplexity as score
        from dynalm.store.catalog import ModelStore

        if text_file == "-":
            text = _read_prompt("-") or ""
        else:
            try:
                text = Path(text_file).read_bytes().decode()
            except UnicodeDecodeError as e:
                raise InvalidRequest(f"{text_file} is not UTF-8 text (at byte {e.start})") from None
        loaded = load_model(ModelStore().resolve(model))
        _context(ctx, loaded)
        tok = loaded.tokenizer
        # a token past the window: the engine samples one after each window (never computed)
        config = EngineConfig(
            ctx=ctx + 1, kv_cache_dtype=kv_cache_dtype.value, enable_prefix_caching=False
        )
        from dynalm.runtime.engine.build import build_engine

        engine = build_engine(_engine_spec(loaded, config, backend, cpu, gpu, mode, threads))
        ids = tok.encode(text, add_special=False)
        bos = tok.bos_id if tok.add_bos else None
        columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task("windows", total=max(1, len(ids) // ctx))
            result = score(engine, ids, ctx, bos, lambda done: bar.update(task, completed=done))
        typer.echo(result.summary())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
