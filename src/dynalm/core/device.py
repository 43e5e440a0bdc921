"""The Device interface: where weights, activations and KV pages live, and the kernels
that run there.

A ``Device`` prepares each weight for itself, owns the step's buffers and the KV pages'
bytes, and runs its kernels; it never sees a graph node (``ir.lower`` binds a graph's ops to
a device's kernels). The devices: ``cpu_device.CpuDevice``, ``cuda_device.CudaDevice``
(preview); which one runs a model is ``devices.select_device``'s choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from dynalm.core.kv_storage import KVGeometry, KVStorage

MODES = ("auto", "exact", "safe")


@dataclass(frozen=True)
class MatmulKernel:
    """The matmul a weight gets on a device, and the bytes the device holds for it."""

    kind: str  # the device's name for it, e.g. "jit-auto"
    nbytes: int


class Device(ABC):
    """Where a graph runs: weights prepared for it, buffers, KV pages and kernels.

    A new backend is one device class (this interface), its binder (``ir.lower``: an op
    table covering ``ir/ops.py``'s ``OPS``) and one ``GPU_KINDS`` entry; the kernels it runs
    come from its own kernel-language lowering module.
    """

    name: ClassVar[str]
    mode: str  # auto | exact | safe (what the memory plan sizes the weights for)
    threads: int
    repack_seconds = 0.0  # spent preparing weights (--verbose, bench)
    repacked = mapped = 0  # weights prepared anew / mapped from a cache of prepared ones

    @abstractmethod
    def describe(self) -> str:
        """One line for --verbose: the device and how it runs kernels."""

    # -- what it can run, and what it holds: asked before any weight is read
    @abstractmethod
    def supports(
        self,
        op: str,
        weights: tuple[tuple[int, tuple[int, ...]], ...],
        attrs: Mapping[str, object] = MappingProxyType({}),
    ) -> bool:
        """Whether this device has a kernel for ``op`` of the IR (``ir/ops.py``) over weights
        of these (ggml type, shape) and with these attributes."""

    @abstractmethod
    def matmul_kernel(self, ggml_type: int, shape: tuple[int, int]) -> MatmulKernel:
        """The matmul a weight ``[N, K]`` of ``ggml_type`` gets here, and its bytes."""

    @abstractmethod
    def prepared_bytes(self, ggml_type: int, shape: tuple[int, ...], use: str) -> int:
        """Bytes this device holds for a weight prepared for ``use`` (matmul, embedding,
        vector, index): what the memory plan counts."""

    # -- weights: each prepared once, for this device
    @abstractmethod
    def vector(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> object:
        """A small weight (norm scale, bias)."""

    @abstractmethod
    def matmul(self, raw: object, ggml_type: int, shape: tuple[int, int], **how: object) -> object:
        """A matmul weight ``[N, K]`` prepared as ``out = x @ W.T``."""

    @abstractmethod
    def embedding(
        self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], **how: object
    ) -> object:
        """A row lookup table."""

    def holds_copy(self, prepared: object) -> bool:
        """Whether a prepared matmul weight keeps its own copy (the file's bytes may go)."""
        return False

    # -- buffers
    @abstractmethod
    def buffer(self, rows: int, width: int, dtype: type = np.float32) -> np.ndarray:
        """A planned activation or input buffer ``[rows, width]`` in this device's memory
        (sliced by rows for each step's token count)."""

    @abstractmethod
    def kv_storage(self, geometry: KVGeometry) -> KVStorage:
        """The KV pages' bytes, in the layout this device's attention reads (the runtime's
        ``PagePool`` keeps the accounting: ids, refcounts, recent buffers)."""
