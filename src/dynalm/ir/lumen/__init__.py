"""Lumen: the typed model language whose ``.lum`` files describe each architecture.

``load_program`` parses and statically checks a file; ``Elaborator`` runs it against a
model file's metadata and tensor types and yields its DynaIR graph. See ``docs/lumen.md``.
"""

from dynalm.ir.lumen.elaborate import Elaborator
from dynalm.ir.lumen.program import Program, load_file, load_program
from dynalm.ir.lumen.tree import LumenError

__all__ = ["Elaborator", "LumenError", "Program", "load_file", "load_program"]
