"""What an operator sets on `exactspec serve`: one frozen ServeOptions, every limit answering with a
clear 4xx; built from the CLI's flags by `from_args` (each flag is named as its field)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from ..errors import InvalidRequest


@dataclass(frozen=True)
class ServeOptions:
    """What `exactspec serve` lets an operator set; every limit answers with a clear 4xx."""
    _MAY_BE_ZERO = ("prefix_cache_mb",)
    max_batch: int = 8  # sequences decoded together
    prefill_chunk: int = 16  # prompt tokens fed per step: a long prompt interleaves with the others' decoding
    max_queue: int = 64  # waiting requests before 429
    max_n: int = 8  # choices (n, best_of) per request
    max_prompts: int = 64  # prompts per completions request (a list of texts or of token-id lists)
    logprobs_mode: str = "raw"  # "raw" or "processed" (after the sampling filters), as vLLM's flag
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/*
    protect_metrics: bool = False  # the key on /health and /metrics too
    max_body_bytes: int = 1 << 20  # 413 above
    max_stops: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_prompt_chars: int = 1 << 20  # a rendered chat prompt's characters
    allowed_hosts: tuple[str, ...] = ()  # Host header values accepted (empty: any)
    max_connections: int = 512  # uvicorn's limit_concurrency: 503 above
    keep_alive: float = 5.0  # idle keep-alive connections close after this
    read_timeout: float = 15.0  # a request's headers and body must arrive within this
    shutdown_grace: float = 10.0  # on SIGTERM/SIGINT: seconds in-flight requests may still finish
    prefix_cache_mb: int = 256  # KV blocks of earlier prompts kept for reuse (exact: same bits); 0: off
    prefix_cache_scope: str = "shared"  # "shared" or "authorization": only requests with the same
    #   Authorization header share blocks (a cache hit answers faster: a timing side channel between tenants)
    draft_branches: int = 1  # tree verification: up to N-1 runners-up of a head's first draft token, where they pay

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            zero_ok = f.name in self._MAY_BE_ZERO
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (v < 0 or v == 0 and not zero_ok):
                raise InvalidRequest(f"--{f.name.replace('_', '-')} {v}: must be {'>= 0' if zero_ok else '> 0'}",
                                     f.name)
        if self.prefix_cache_scope not in ("shared", "authorization"):
            raise InvalidRequest(f"--prefix-cache-scope {self.prefix_cache_scope!r}: 'shared' or 'authorization'",
                                 "prefix_cache_scope")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ServeOptions":
        """From `exactspec serve`'s flags, each named as its field (--max-batch: max_batch); the API
        key falls back to $EXACTSPEC_API_KEY."""
        kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)}
        kw["allowed_hosts"] = tuple(kw.get("allowed_hosts") or ())
        kw["api_key"] = kw.get("api_key") or os.environ.get("EXACTSPEC_API_KEY") or None
        return cls(**kw)
