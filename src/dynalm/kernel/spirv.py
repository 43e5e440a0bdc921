"""SPIR-V, compile-only preview: the element-wise programs lowered by LLVM's SPIR-V target.

The element-wise programs (``kernel.elementwise_programs``) are built for
``spirv64-unknown-unknown`` at the NVPTX backend's width and get the same entry kernels as
on the GPU (``nvptx.add_entries``: rows split over threads, a per-thread argument block), in
the ``spir_kernel`` calling convention with the thread index from OpenCL's
``get_global_id(0)``. LLVM emits a SPIR-V binary with ``Kernel`` execution-model entry
points (physical 64-bit addressing, as OpenCL drivers take it). Nothing loads or runs it
here: there is no Vulkan/OpenCL runtime binding, and Vulkan itself takes only the ``Shader``
model with logical addressing, which these pointer-arithmetic programs do not fit yet. CI
checks the binary's header (magic number 0x07230203) and that it has an entry point per
kernel (``entry_points``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import llvmlite.binding as llvm
import llvmlite.ir as ir

from dynalm.kernel import nvptx
from dynalm.kernel.backends import Program, Spec
from dynalm.kernel.lang import I32, I64, Kernel, Module

TRIPLE = "spirv64-unknown-unknown"
MAGIC = 0x07230203
_OP_ENTRY_POINT = 15
_GET_GLOBAL_ID = "_Z13get_global_idj"  # OpenCL's size_t get_global_id(uint), Itanium-mangled
# The element-wise programs the preview covers: a dense model's (no stack arrays, no calls)
_KINDS = ("add", "mul", "scale", "act", "gated", "bias", "columns", "rows", "rms_norm", "rope")
PROGRAMS = frozenset(f"ew_{kind}" for kind in _KINDS)


@dataclass(frozen=True)
class SpirvModule:
    binary: bytes
    entries: dict[str, str]  # short name -> entry point name


def _global_id(k: Kernel) -> ir.Value:
    return k.call(_GET_GLOBAL_ID, I64, ir.Constant(I32, 0))


def _machine() -> llvm.TargetMachine:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE).create_target_machine(opt=2)


def lower(program: Program, spec: Spec) -> SpirvModule:
    """``program`` (an element-wise program) as a SPIR-V binary with entry kernels."""
    if program.name not in PROGRAMS:
        raise ValueError(f"SPIR-V preview covers the element-wise programs, not {program.name!r}")
    tm = _machine()
    module = Module(nvptx.module_name("spirv", program, spec), nvptx.NVPTX, TRIPLE)
    module.ir.data_layout = str(tm.target_data)
    program.build(module, **spec)
    nvptx.add_entries(module, program, spec, cc="spir_kernel", thread=_global_id)
    mod = llvm.parse_assembly(module.text())
    mod.verify()
    binary = tm.emit_object(mod)
    entries = {short: f"{full}_grid" for short, full, _ in module.entries}
    return SpirvModule(binary, entries)


def entry_points(binary: bytes) -> list[str]:
    """The names of a SPIR-V binary's ``OpEntryPoint``s; raises ValueError when it is not
    a SPIR-V module (magic number, header, instruction lengths)."""
    if len(binary) < 20 or len(binary) % 4:
        raise ValueError(f"not a SPIR-V module: {len(binary)} bytes is no whole header/words")
    words = struct.unpack(f"<{len(binary) // 4}I", binary)
    if words[0] != MAGIC:
        raise ValueError(f"not a SPIR-V module: magic number {words[0]:#010x}, not {MAGIC:#010x}")
    if words[4] != 0:
        raise ValueError(f"SPIR-V header: schema word {words[4]} is not 0")
    names, at = [], 5
    while at < len(words):
        count, opcode = words[at] >> 16, words[at] & 0xFFFF
        if count == 0 or at + count > len(words):
            raise ValueError(f"SPIR-V word {at}: instruction length {count} runs past the end")
        if opcode == _OP_ENTRY_POINT:  # model, function id, then the name, NUL-terminated
            raw = struct.pack(f"<{count - 3}I", *words[at + 3 : at + count])
            names.append(raw.split(b"\0", 1)[0].decode())
        at += count
    return names
