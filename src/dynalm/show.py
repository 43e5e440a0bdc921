"""Human-readable descriptions for ``dynalm show``: a model, or this machine."""

from __future__ import annotations

import platform
from collections import Counter

from dynalm.core.device import physical_cores
from dynalm.core.quant import quant_format
from dynalm.models.loader import LoadedModel


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def describe_model(model: LoadedModel) -> str:
    hp = model.hparams
    types = Counter(quant_format(t.ggml_type).name for t in model.gguf.tensors.values())
    lines = [
        f"  name                {model.name}",
        f"  file                {model.path}",
        f"  architecture        {hp.arch}",
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
    template = model.chat_template.source.strip()
    lines += ["", "  chat template", *("    " + ln for ln in template.splitlines())]
    return "Model\n" + "\n".join(lines)


def describe_system() -> str:
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
    simd = [
        f
        for f in ("avx512_vnni", "avx512f", "avx_vnni", "avx2", "fma", "f16c", "asimd", "asimddp")
        if f in flags
    ]
    return "\n".join(
        [
            "System",
            f"  cpu                 {name}",
            f"  physical cores      {physical_cores()}",
            f"  vector features     {' '.join(simd) or 'none detected'}",
            f"  python              {platform.python_version()}",
        ]
    )
