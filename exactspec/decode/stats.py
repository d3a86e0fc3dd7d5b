"""What decoding reports: one sequence's figures (Stats) and a whole batch's (BatchStats)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    """One sequence's figures; every field means this sequence only."""
    prompt_tokens: int = 0
    new_tokens: int = 0  # committed tokens (for a cancelled sequence: those committed before it left)
    forward_passes: int = 0  # target forwards this sequence took part in (its prefill counts one)
    proposed: int = 0  # draft tokens proposed for it
    accepted: int = 0  # ... and accepted
    steps: int = 0  # verify steps (its forwards after the prefill)
    time_to_first_token: float = 0.0  # seconds from joining the batch to its first token
    wall_time: float = 0.0  # seconds from joining the batch to finishing (or being cancelled)
    cached_tokens: int = 0  # prompt tokens whose keys came from the prefix cache
    prediction_accepted: int = 0  # draft tokens taken from the request's prediction and accepted
    prediction_rejected: int = 0  # ... and rejected
    siblings: int = 0  # tree verification: other first tokens verified beside the draft (each in a helper slot)
    sibling_accepted: int = 0  # ... that were the target's token
    seed: int | None = None  # the sampling seed used (temperature > 0), so a run with seed=None replays
    proposed_at: list[int] = field(default_factory=list)  # [i]: steps that proposed a draft token at offset i
    accepted_at: list[int] = field(default_factory=list)  # [i]: ... and had it accepted

    def count_step(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "tokens_per_second": self.tokens_per_second}


@dataclass
class BatchStats:
    """A whole batch's figures (generate_batch, the engine): shared work, not per sequence."""
    sequences: int = 0  # sequences that joined
    new_tokens: int = 0  # tokens committed, all sequences
    forward_passes: int = 0  # target forwards
    draft_forward_passes: int = 0  # the drafter's forwards (a draft model; 0 for prompt lookup)
    cancelled: int = 0  # sequences cancelled before they finished
    cancelled_tokens: int = 0  # tokens those had committed (work done for nobody)
    failed: int = 0  # sequences ended by an error while they were stepped (finish_reason "error")
    wall_time: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_second": self.tokens_per_second}
