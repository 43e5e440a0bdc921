"""The KV-format table: one row per ``--kv-cache-dtype``, read by every layer that needs one.

A row says how a KV page stores a value (its element type, and whether blocks of values
share an f16 scale: then the keys are also stored Hadamard-rotated per block, see
``kv_storage.hadamard``), what a token's keys and values take, and the recent-row rule: how
many of each running sequence's last tokens a pool also keeps in f16, where attention reads
the keys and values near a query. The page storage (``kv_storage``), the attention kernels'
binding (``attention``), the runtime's page pool and memory plan and the CLI's choices read
it; a new format is one row here and its kernels (``kernel.attention_program``'s load and store of
the element type). It imports nothing heavy: the CLI reads it to list the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynalm.errors import InvalidRequest, show


@dataclass(frozen=True)
class KVFormat:
    name: str  # what --kv-cache-dtype takes
    store: str  # the numpy dtype of a stored value
    item_bytes: int  # bytes of a stored value
    scale_block: int = 0  # values per f16 scale (0: none); keys stored rotated per block
    recent: int = 0  # tokens of each running sequence also kept in f16 (0: no recent buffers)

    @property
    def value_bytes(self) -> float:
        """Bytes of one value in a page, its share of a scale included."""
        return self.item_bytes + (2.0 / self.scale_block if self.scale_block else 0.0)

    def token_bytes(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of one token's keys and values in a pool of this format."""
        return int(2 * n_layers * n_kv_heads * head_dim * self.value_bytes)

    def recent_bytes(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of one running sequence's recent buffer (f16 keys and values)."""
        return self.recent * KV_FORMATS["f16"].token_bytes(n_layers, n_kv_heads, head_dim)

    def check(self, head_dim: int) -> None:
        """Refuse heads this format cannot store (a scale block must not straddle two)."""
        if self.scale_block and head_dim % self.scale_block:
            raise InvalidRequest(
                f"{self.name} KV needs head_dim divisible by {self.scale_block}, got {head_dim}"
            )


KV_FORMATS: dict[str, KVFormat] = {
    row.name: row
    for row in (
        KVFormat("f32", "float32", 4),
        KVFormat("f16", "float16", 2),
        KVFormat("q8_0", "int8", 1, scale_block=32, recent=32),
    )
}


def kv_format(name: str) -> KVFormat:
    """The table row of ``--kv-cache-dtype name``."""
    if name not in KV_FORMATS:
        raise InvalidRequest(
            f"unknown KV cache dtype {show(name)} (choose from {', '.join(KV_FORMATS)})"
        )
    return KV_FORMATS[name]
