"""A coverage-guided fuzz target (atheris / libFuzzer) for the GGUF header parser.

Each input is taken as a whole GGUF file: `GGUFFile` parses it, then `read_hparams` checks
the hyper-parameters against the tensor shapes. The only acceptable failures are
``DynaError``s; any other exception is a crash that libFuzzer reports (with the input
saved as ``crash-*``). Run by ``test_gguf_fuzz.py`` with a bounded number of executions::

    python gguf_atheris.py -runs=20000 -max_len=8192 SEED_DIR
"""

from __future__ import annotations

import os
import sys

import atheris
import gguf  # noqa: F401  (imported first: instrument only DynaLM's own code)
import numpy  # noqa: F401

with atheris.instrument_imports():
    from dynalm.errors import DynaError
    from dynalm.models.gguf_file import GGUFFile
    from dynalm.models.hparams import read_hparams

_FD = os.memfd_create("gguf-fuzz")  # the input as a file, without touching the disk
_PATH = f"/proc/self/fd/{_FD}"


def test_one_input(data: bytes) -> None:
    os.ftruncate(_FD, 0)
    os.pwrite(_FD, data, 0)
    try:
        with GGUFFile(_PATH) as f:
            read_hparams(f.metadata, {name: t.shape for name, t in f.tensors.items()})
    except DynaError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
