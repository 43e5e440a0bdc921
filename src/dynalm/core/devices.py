"""Device discovery and selection: which device runs a model.

``select_device`` picks the CPU, or per GPU kind (``GPU_KINDS``) an entry with a probe
(available here, or why not), its memory, and its device class; ``--backend auto`` takes the
first GPU that is available, holds the model's memory plan and starts, else the CPU (the
reasons logged). CUDA is a preview (``core.cuda_device``, probed through the driver binding
``core.cuda_driver``); Metal and Vulkan have no device class yet, so their entries say why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from dynalm.core import cuda_driver
from dynalm.core.cpu_device import CpuDevice, physical_cores
from dynalm.core.device import Device
from dynalm.errors import DeviceUnavailable, InvalidRequest
from dynalm.kernel import backends, jit, matmul_programs

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "gpu")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class DeviceKind:
    """One kind of GPU device ``--backend auto|gpu`` may choose: whether this machine can
    run it (``probe``: None, or why not in one line), how much memory it has, and its device
    class (``create(mode, threads)``; None until that class is built)."""

    name: str
    label: str
    probe: Callable[[], str | None]
    memory: Callable[[], int] | None = None  # bytes of device memory, asked once usable
    create: Callable[[str, int | None], Device] | None = None

    def unavailable(self) -> str | None:
        """None when this kind can run a model here, else why not."""
        reason = self.probe()
        if reason is None and self.create is None:
            reason = f"no {self.label} device class is built into this DynaLM yet"
        return reason

    def too_small(self, need: int) -> str | None:
        """Why a model needing ``need`` bytes of device memory does not fit, or None."""
        have = self.memory() if self.memory is not None else None
        if have is not None and need > have:
            return (
                f"the model needs {_mib(need)} of device memory (weights, KV pool, "
                f"activations of the memory plan), the {self.label} device has {_mib(have)}"
            )
        return None


def _cuda_probe() -> str | None:
    """None when a CUDA device is usable (the driver binding's probe), else why not."""
    return cuda_driver.probe()


def _cuda_device(mode: str, threads: int | None) -> Device:
    from dynalm.core.cuda_device import CudaDevice

    device = CudaDevice(mode, threads)
    device.self_check()
    return device


def _cuda_memory() -> int:
    return max(d.total_memory for d in cuda_driver.devices(cuda_driver.load()))


# The GPU kinds in the order ``--backend auto`` tries them. A new GPU backend is one entry
# here (probe, memory, its Device class as ``create``).
GPU_KINDS: list[DeviceKind] = [
    DeviceKind("cuda", "CUDA (preview)", _cuda_probe, _cuda_memory, _cuda_device),
    DeviceKind(
        "vulkan", "Vulkan", lambda: "no Vulkan device support built yet (SPIR-V preview only)"
    ),
    DeviceKind("metal", "Metal", lambda: "no Metal device support built yet"),
]


def select_device(
    backend: str = "auto",
    mode: str = "auto",
    threads: int | None = None,
    need: Callable[[Device], int] | None = None,
    unsupported: Callable[[Device], str | None] | None = None,
) -> Device:
    """The device for ``--backend``: ``cpu``; ``gpu``: the first GPU kind available here
    whose device starts (and passes its self-check), can run the model (``unsupported``:
    None, or why not: an op or weight its kernels do not take) and holds it (``need``: the
    bytes of device memory its memory plan asks for), else ``DeviceUnavailable`` with the
    reasons; ``auto``: that GPU, else the CPU (the reasons logged, shown with --verbose).
    Both questions are asked before any weight is read."""
    if backend not in BACKENDS:
        raise InvalidRequest(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if backend == "cpu":
        return CpuDevice(mode, threads)
    reasons = []
    for kind in GPU_KINDS:
        reason = kind.unavailable()
        if reason is None and mode == "safe":
            reason = "--mode safe is the CPU's fp32 numpy reference"
        if reason is None:
            assert kind.create is not None  # unavailable() says so otherwise
            try:
                device = kind.create(mode, threads)
            except DeviceUnavailable as e:  # it failed to start or its self-check
                reasons.append(f"{kind.name}: {e}")
                continue
            reason = unsupported(device) if unsupported is not None else None
            if reason is None and need is not None:
                reason = kind.too_small(need(device))
            if reason is None:
                log.info("backend %s: using %s", backend, kind.label)
                return device
        reasons.append(f"{kind.name}: {reason}")
    why = "; ".join(reasons)
    if backend == "gpu":
        raise DeviceUnavailable(f"--gpu: no usable GPU ({why}); use --cpu")
    log.info("backend auto: using the CPU (%s)", why)
    return CpuDevice(mode, threads)


def _cpu_backend() -> str:
    """The CPU kernels' backend, or why there is none."""
    try:
        return backends.select().name
    except backends.BackendUnavailable as e:
        return f"none ({e})"


def describe_devices() -> list[str]:
    """``dynalm show --system``'s devices: the CPU with its kernel backend, and each GPU
    kind with whether it is available here or why not."""
    lines = [f"  {'cpu':<8}available: kernels {_cpu_backend()} ({physical_cores()} cores)"]
    for kind in GPU_KINDS:
        reason = kind.unavailable()
        lines.append(
            f"  {kind.name:<8}{'available' if reason is None else 'unavailable: ' + reason}"
        )
    return lines


def describe_kernels() -> list[str]:
    """``dynalm show --system``'s kernels: the JIT's target and features; the backend the
    CPU's kernels are built for (``$DYNALM_ISA`` overrides the host's best); each backend,
    whether this host runs it natively, its width and int8 dot."""
    host = jit.host_features()
    lines = [
        f"  jit target          {host['cpu']} ({host['triple']}, llvmlite {host['llvmlite']})",
        f"  jit features        {' '.join(host['features']) or 'none'}",
        f"  kernel backend      {_cpu_backend()}",
    ]
    for b in backends.BACKENDS:
        caps = b.capabilities()
        where = "native" if caps["runs_here"] else f"twin only (lacks {', '.join(caps['missing'])})"
        width, dot = caps["fp32_lanes"], caps["int8_dot"]
        lines.append(f"    {b.name:<16}  {width} fp32 lanes, int8 dot {dot}: {where}")
    return lines


def describe_matmul_buckets() -> list[str]:
    """Per mode, which kernel of the chosen backend serves which batch size T."""
    try:
        backend = backends.select()
    except backends.BackendUnavailable:
        return []
    lines = [f"  matmul kernel by batch size T ({backend.name}; attention, norms: vector code)"]
    for mode in ("exact", "auto"):
        shapes = matmul_programs.buckets(mode, backend)
        ranges = []
        for shape, after in zip(shapes, [*shapes[1:], None], strict=True):
            last = f"-{after.serves - 1}" if after and after.serves - 1 > shape.serves else ""
            span = f"{shape.serves}{last}" if after else f">={shape.serves}"
            ranges.append(f"T {span}: {shape.describe()}")
        lines.append(f"    jit-{mode:<6}        {'; '.join(ranges)}")
    return lines
