"""What speculative decoding did: the verified drafts, counted (vLLM's spec_decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynalm.runtime.engine.config import MAX_DRAFT_TOKENS


@dataclass
class SpecStats:
    """Counters of verified drafts (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verifications of a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFT_TOKENS + 1))

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def summary(self) -> str:
        mean = self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return (
            f"speculative: {self.num_accepted_tokens} of {self.num_draft_tokens} draft tokens "
            f"accepted ({100 * self.acceptance_rate:.1f} %), {self.num_drafts} drafts, "
            f"{mean:.2f} accepted per draft"
        )
