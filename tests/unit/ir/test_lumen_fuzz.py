"""The Lumen fuzzer (issue 25): mutants of the family files and the pathological shapes
(``lumen_fuzz``), each parsed (through the tree cache), checked and elaborated against
SmolLM2's metadata and tensors, must end as a graph or as one located ``case.lum:line:col``
DynaError — never another exception, and never past a time limit.

Bounded like the GGUF fuzzer: ``DYNALM_FUZZ_CASES`` mutants (default 300; a fixed seed for
two thirds, a random one, printed, for the rest: ``DYNALM_FUZZ_SEED`` replays it) within
``DYNALM_FUZZ_SECONDS`` (default 60) of wall time; the shapes always run, each twice (the
second from the cache)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lumen_fuzz import cases, shapes

from dynalm.errors import DynaError
from dynalm.ir.lumen import Elaborator, load_program
from dynalm.ir.passes import verify
from dynalm.models.arch import GIVEN, tensor_types
from dynalm.models.gguf_file import GGUFFile
from dynalm.models.hparams import read_hparams

FIXED_SEED = 25
CASE_SECONDS = int(
    os.environ.get("DYNALM_FUZZ_CASE_SECONDS", "40")
)  # past the elaborator's own 20 s budget: a hang
MAX_MESSAGE = 600


class Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path) -> Iterator[tuple[dict, dict, dict]]:
    import dataclasses

    with GGUFFile(smollm2_gguf) as f:
        hp = read_hparams(f.metadata, {n: t.shape for n, t in f.tensors.items()})
        yield dict(f.metadata), tensor_types(f), dataclasses.asdict(hp)


def outcome(text: str, model: tuple[dict, dict, dict]) -> str:
    """What is wrong with how ``text`` was handled, if anything ("graph", "refused": fine)."""
    metadata, weights, given = model
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        program = load_program(text, "case.lum", cached=True, given=GIVEN)
        arch = program.families[0]
        verify(Elaborator(program, arch, metadata, weights, given).run())  # as dynalm check
    except DynaError as e:
        message = str(e)
        if not message.startswith("case.lum:") or "\n" in message or len(message) > MAX_MESSAGE:
            return f"an error that is not one located line: {message[:300]!r}"
        return "refused"
    except Hang:
        return f"still running after {CASE_SECONDS} s"
    except BaseException as e:  # noqa: BLE001 - any other exception is the defect sought
        return f"internal error {type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return "graph"


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNALM_CACHE", str(tmp_path))


def test_the_pathological_shapes_are_located_errors(model: tuple[dict, dict, dict]):
    failures = []
    for name, text in shapes():
        for attempt in ("parsed", "cached"):
            if (wrong := outcome(text, model)) != "refused":
                failures.append(f"{name} ({attempt}): {wrong}")
    assert not failures, "\n".join(failures)


def test_fuzz_family_files(model: tuple[dict, dict, dict]):
    seed = int(os.environ.get("DYNALM_FUZZ_SEED") or random.randrange(2**32))
    n = int(os.environ.get("DYNALM_FUZZ_CASES", "300"))
    budget = float(os.environ.get("DYNALM_FUZZ_SECONDS", "60"))
    chosen = list(cases(random.Random(FIXED_SEED), 2 * n // 3))
    chosen += list(cases(random.Random(seed), n - len(chosen)))
    t0, ran, failures, ends = time.monotonic(), 0, [], {"graph": 0, "refused": 0}
    for name, text in chosen:
        if time.monotonic() - t0 > budget:
            break
        result = outcome(text, model)
        ran += 1
        if result in ends:
            ends[result] += 1
        else:
            failures.append(f"{name}: {result}")
    print(
        f"Lumen fuzz: fixed seed {FIXED_SEED}, random seed {seed}: {ran} of {len(chosen)} cases "
        f"in {time.monotonic() - t0:.1f} s: {ends['graph']} graphs, {ends['refused']} located "
        f"errors, {len(failures)} failures"
    )
    assert ran >= min(n, 50), "too few cases ran within the time budget"
    assert not failures, f"seed {seed}: {len(failures)} of {ran} cases:\n" + "\n".join(failures)
