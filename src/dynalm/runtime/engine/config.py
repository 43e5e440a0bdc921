"""What an engine is configured with: ``EngineConfig`` (the CLI's flags and the server's)."""

from __future__ import annotations

from dataclasses import dataclass

from dynalm.errors import InvalidRequest

MAX_DRAFT_TOKENS = 16


@dataclass
class EngineConfig:
    ctx: int = 4096  # most tokens per sequence (prompt + generated)
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 16  # most sequences in the running batch
    max_queue: int = 256  # most waiting requests before QueueFull
    page_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: max_num_seqs * ctx tokens, capped at 2 GiB
    kv_cache_dtype: str = "f16"  # a row of core.kv_formats.KV_FORMATS
    enable_prefix_caching: bool = True
    num_draft_tokens: int = 4  # most draft tokens per sequence and step (with a drafter)
    adaptive_draft: bool = True  # fewer (or none) where drafts are rejected; else always k


def check_num_draft_tokens(k: int) -> int:
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
    return k
