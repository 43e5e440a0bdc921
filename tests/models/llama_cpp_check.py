"""Run a GGUF through llama.cpp's own loader and graph (llama-cpp-python), in a process of
its own, and return its logits: the check that a file the tests write is a file llama.cpp
accepts and computes the same model from.

A subprocess, because llama.cpp's OpenMP threads spin-wait beside the test process's (and
OpenBLAS's) on a small machine, and because a file llama.cpp rejects may abort the process
(a ``GGML_ASSERT``) rather than raise.

The context asks for an F32 KV cache and no flash attention, so llama.cpp computes a tiny
F32 model in fp32 except where its graph itself rounds to fp16 (GELU: see
`test_llama_cpp_loads`).

    python tests/models/llama_cpp_check.py FILE.gguf OUT.npy ID [ID ...]
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TIMEOUT_S = 120
GGML_TYPE_F32 = 0  # ggml's type id, for type_k / type_v (an F32 KV cache)
MIN_CTX = 64  # the context asked for (llama.cpp pads it to a multiple of 256)


def unavailable() -> str | None:
    """Why the check cannot run here (None when llama-cpp-python is importable)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'dynalm[bench]')"
    return None


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [len(ids), n_vocab] for ``ids`` evaluated from an empty cache in
    one batch; raises AssertionError with llama.cpp's own message if it refuses the file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        cmd = [sys.executable, __file__, str(path), str(out), *map(str, ids)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise AssertionError(
                f"llama.cpp could not run {path.name} (exit {proc.returncode}):\n{tail}"
            )
        return np.load(out)


def _main(path: str, out: str, ids: list[int]) -> None:
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_ctx=max(MIN_CTX, len(ids)),
        n_batch=len(ids),
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        flash_attn=False,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=True,  # llama.cpp's log on stderr: the reason when it refuses a file
    )
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]])
