"""Runs model files the way ``dynalm run`` does, each in a forked child under limits.

Started by the fuzz tests as a fresh interpreter (no threads, nothing else loaded), it
warms up on a valid model so that every JIT kernel the children need is already compiled,
then reads one JSON request per line on stdin, ``{"path": ...}``, and answers one JSON line
on stdout per request::

    {"status": "ok" | "refused" | "crashed" | "killed", "phase": "load" | "run",
     "message": <the error, or a traceback, or the signal>, "seconds": ...}

A child loads the file (``load_model``), binds it to the CPU device in ``auto`` mode,
renders a chat prompt and generates two greedy tokens: exit 0 is ``ok``; a ``DynaError``
is ``refused`` (its message); any other exception is ``crashed`` (its traceback); a signal
is ``killed``: a segfault, or SIGALRM / SIGXCPU when the child hangs. Each child runs under
``RLIMIT_AS`` (its address space at fork plus ``--memory`` MiB, so a file that makes the
loader allocate gigabytes fails with MemoryError: ``crashed``) and ``alarm(--timeout)``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from dynalm.core.cpu_device import CpuDevice
from dynalm.errors import DynaError
from dynalm.models.loader import load_model
from dynalm.runtime.engine.engine import Engine
from dynalm.runtime.engine.sampling import SamplingParams
from dynalm.runtime.generator import Generator, generator_config


def run_model(path: str, phase: list[str]) -> None:
    """What ``dynalm run PATH hi --temperature 0 --max-tokens 2 --threads 1`` does."""
    phase[0] = "load"
    model = load_model(path)
    phase[0] = "run"
    generator = Generator(Engine(model, CpuDevice("auto", threads=1), generator_config(64, "f16")))
    prompt = model.chat_template.render([{"role": "user", "content": "hi"}])
    ids = model.tokenizer.encode(prompt, add_special=False)
    for _ in generator.generate(ids, SamplingParams(max_tokens=2, temperature=0.0)):
        pass


def _child(path: str, out: int, memory_mib: int, timeout: int) -> None:
    pages = int(Path("/proc/self/statm").read_text().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + (memory_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (timeout + 2, timeout + 2))
    signal.alarm(timeout)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stdout carries the worker's answers
    phase = ["load"]
    try:
        run_model(path, phase)
        status, message = "ok", ""
    except DynaError as e:
        status, message = "refused", str(e)
    except BaseException:
        status, message = "crashed", traceback.format_exc()
    os.write(out, json.dumps({"status": status, "phase": phase[0], "message": message}).encode())
    os._exit(0)


def check(path: str, memory_mib: int, timeout: int) -> dict:
    read, write = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(path, write, memory_mib, timeout)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        result = {"status": "killed", "phase": "?", "message": f"killed by {name}"}
    else:
        result = json.loads(data)
    return result | {"seconds": round(time.monotonic() - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm-up", required=True, help="a valid model to compile kernels with")
    ap.add_argument("--memory", type=int, default=1024, help="MiB a child may add")
    ap.add_argument("--timeout", type=int, default=20, help="seconds a child may run")
    args = ap.parse_args()
    run_model(args.warm_up, ["load"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        result = check(json.loads(line)["path"], args.memory, args.timeout)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
