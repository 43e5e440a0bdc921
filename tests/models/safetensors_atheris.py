"""A coverage-guided fuzz target (atheris / libFuzzer) for the SafeTensors header parser.

Each input is taken as a whole SafeTensors file: `SafeTensorsFile` parses and checks its
header, then every tensor is viewed with its dtype and shape. The only acceptable failures
are ``DynaError``s; any other exception is a crash that libFuzzer reports. Run by
``test_safetensors.py`` with a bounded number of executions::

    python safetensors_atheris.py -runs=20000 -max_len=16384 SEED_DIR
"""

from __future__ import annotations

import os
import sys

import atheris
import numpy  # noqa: F401  (imported first: instrument only DynaLM's own code)

with atheris.instrument_imports():
    from dynalm.errors import DynaError
    from dynalm.models.safetensors_file import SafeTensorsFile

_FD = os.memfd_create("safetensors-fuzz")  # the input as a file, without touching the disk
_PATH = f"/proc/self/fd/{_FD}"


def test_one_input(data: bytes) -> None:
    os.ftruncate(_FD, 0)
    os.pwrite(_FD, data, 0)
    try:
        f = SafeTensorsFile(_PATH)
        for name, t in f.tensors.items():
            if t.dtype not in ("F8_E4M3", "F8_E5M2"):
                f.array(name)
    except DynaError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
