"""`SeqState`: one request while it is in a batch (its tokens, slot, prefill progress, figures and
drafting policy). The loop (loop.py) steps it; the chunker (chunking.py) plans its prompt's chunks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .constraint import Matcher
from .policy import Policy
from .request import Request
from .sampling import TokenLogprob
from .stats import Stats


@dataclass
class SeqState:
    """A request while it is in a batch."""
    req: Request
    slot: int
    tokens: list[int]  # prompt + generated
    policy: Policy  # how much it drafts, step by step (decode/policy.py)
    tag: object = None  # the caller's handle (engine request, prompt index)
    finish_reason: str | None = None  # "stop" (EOS) | "length" | "cancelled" | "error"
    error: Exception | None = None  # what ended it, when finish_reason is "error"
    fed: int = 0  # prompt tokens in the cache so far (a prompt may be fed in chunks, or start in shared blocks)
    kept: int = 0  # its first blocks handed to the prefix cache
    credit: int = 0  # key positions its prefill's attention may still read while others decode
    joined_at: float = field(default_factory=time.perf_counter)
    stats: Stats = field(default_factory=Stats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if the request asks
    matcher: Matcher | None = None  # where its tokens are in the request's constraint (decode/constraint.py)
    guessed: int = 0  # this step's draft tokens that are the drafter's guesses (not text the grammar forces)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.req.prompt):]

    @property
    def prefilled(self) -> bool:
        """The whole prompt is in the cache (its first token picked at that step)."""
        return self.fed == len(self.req.prompt)

    @property
    def cached(self) -> int:
        """Positions whose keys and values are in the cache (all tokens but the last, once prefilled)."""
        return len(self.tokens) - 1 if self.prefilled else self.fed
