"""Human-readable descriptions for ``dynalm show``: a model, or this machine."""

from __future__ import annotations

import platform
from collections import Counter

from dynalm.core.cpu_device import CpuDevice, physical_cores
from dynalm.core.device import MODES
from dynalm.core.devices import describe_devices, describe_kernels, describe_matmul_buckets
from dynalm.core.quant import QUANT_FORMATS, tensor_type_name
from dynalm.ir.ops import OPS
from dynalm.models.gptq_awq import describe
from dynalm.models.loader import LoadedModel
from dynalm.runtime.engine.memory_plan import MemoryPlan


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def describe_model(model: LoadedModel, plan: MemoryPlan | None = None) -> str:
    hp = model.hparams
    types = Counter(tensor_type_name(t.ggml_type) for t in model.gguf.tensors.values())
    quant = getattr(model.gguf, "quant", None)  # a GPTQ/AWQ directory: repacked at load
    lines = [
        f"  name                {model.name}",
        f"  file                {model.path}",
        f"  architecture        {hp.arch}",
        *([f"  quantization        {describe(quant)} (repacked at load)"] if quant else []),
        f"  parameters          {_count(model.n_params)}",
        f"  tensors             {len(model.gguf.tensors)}",
        f"  quant types         {', '.join(f'{k} x{v}' for k, v in types.most_common())}",
        f"  context length      {hp.n_ctx_train}",
        f"  embedding length    {hp.d_model}",
        f"  layers              {hp.n_layers}",
        f"  heads (kv)          {hp.n_heads} ({hp.n_kv_heads})",
        f"  vocabulary          {hp.n_vocab}",
        f"  rope base           {hp.rope_base:g}",
    ]
    if hp.sliding_window:
        lines.append(f"  sliding window      {hp.sliding_window}")
    if plan is not None:
        lines += ["", "  " + plan.describe().replace("\n", "\n  ")]
    template = model.chat_template.source.strip()
    lines += ["", "  chat template", *("    " + ln for ln in template.splitlines())]
    return "Model\n" + "\n".join(lines)


def cpu_description() -> tuple[str, list[str]]:
    """This CPU's model name and the vector features the kernels care about."""
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
    except OSError:
        pass
    return name, [f for f in _VECTOR_FEATURES if f in flags]


_VECTOR_FEATURES = (
    "amx_int8",
    "amx_bf16",
    "avx512_vnni",
    "avx512f",
    "avx_vnni",
    "avx2",
    "fma",
    "f16c",
    "asimd",
    "asimddp",
)


def describe_system() -> str:
    name, simd = cpu_description()
    jit_ops = [op.name for op in OPS.values() if op.kernel == "jit"]
    return "\n".join(
        [
            "System",
            f"  cpu                 {name}",
            f"  physical cores      {physical_cores()}",
            f"  vector features     {' '.join(simd) or 'none detected'}",
            f"  python              {platform.python_version()}",
            "",
            "Devices (--backend auto tries the GPUs in this order, then the CPU)",
            *describe_devices(),
            "",
            "Kernels",
            *describe_kernels(),
            f"  element-wise        jit: {' '.join(jit_ops)} (safe: numpy)",
            "",
            _matmul_table(),
            *describe_matmul_buckets(),
        ]
    )


def _matmul_table() -> str:
    """Per quant format and mode, the matmul the CPU device picks for a weight of 256
    columns (``CpuDevice.matmul_kernel``)."""
    devices = {mode: CpuDevice(mode, threads=1) for mode in MODES}
    lines = [f"  {'matmul':<10}" + "".join(f"{mode:<14}" for mode in MODES)]
    for ggml_type, fmt in QUANT_FORMATS.items():
        kernels = (devices[mode].matmul_kernel(ggml_type, (1, 256)).kind for mode in MODES)
        lines.append(f"  {fmt.name:<10}" + "".join(f"{k:<14}" for k in kernels))
    return "\n".join(line.rstrip() for line in lines)
