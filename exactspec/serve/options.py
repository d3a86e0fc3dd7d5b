"""What an operator sets on `exactspec serve`: one frozen ServeOptions, every limit answering with a
clear 4xx; built from the CLI's flags by `from_args` (each flag is named as its field)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from ..errors import InvalidRequest


def opt(default, help: str, **flag):
    """A field with its flag's help (and argparse keywords such as `choices`): the one place an
    option's name, type, default and help are written (`add_flags` makes the flags from them)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ServeOptions:
    """What `exactspec serve` lets an operator set; every limit answers with a clear 4xx."""
    _MAY_BE_ZERO = ("prefix_cache_mb",)
    max_batch: int = opt(8, "sequences decoded together")
    prefill_chunk: int = opt(16, "prompt tokens fed per step (a long prompt shares its steps with the others' "
                             "decoding; output identical for any value)")
    max_queue: int = opt(64, "waiting requests before 429")
    max_n: int = opt(8, "choices per request (n, best_of)")
    max_prompts: int = opt(64, "prompts per completions request (a batch)")
    logprobs_mode: str = opt("raw", "logprobs of the model's logits (raw) or after the sampling filters "
                             "(processed), as vLLM's flag", choices=["raw", "processed"])
    api_key: str | None = opt(None, "require Authorization: Bearer KEY on /v1/* (default: $EXACTSPEC_API_KEY; "
                              "none = open)")
    protect_metrics: bool = opt(False, "require the key on /health and /metrics too")
    max_body_bytes: int = opt(1 << 20, "larger request bodies get 413")
    max_stops: int = opt(16, "stop strings per request")
    max_stop_chars: int = opt(256, "characters per stop string")
    max_prompt_chars: int = opt(1 << 20, "characters of a rendered chat prompt")
    allowed_hosts: tuple[str, ...] = opt((), "accepted Host header values (default: any)")
    max_connections: int = opt(512, "open connections before 503 (uvicorn's limit_concurrency)")
    keep_alive: float = opt(5.0, "seconds an idle keep-alive connection stays")
    read_timeout: float = opt(15.0, "seconds a request's headers and body may take")
    shutdown_grace: float = opt(10.0, "on SIGTERM/SIGINT: seconds in-flight requests may finish before each is "
                                "ended cleanly")
    prefix_cache_mb: int = opt(256, "KV blocks of earlier prompts kept for reuse by later ones with the same start "
                               "(output identical on or off); 0: off")
    prefix_cache_scope: str = opt("shared", "share cached prefixes among all requests, or only among those with the "
                                  "same Authorization header (a hit answers faster: a timing side channel between "
                                  "tenants); a request's cache_salt narrows it further",
                                  choices=["shared", "authorization"])
    draft_branches: int = opt(1, "tree verification: up to N-1 runners-up of a head's first draft token verified "
                              "beside it, where the measured costs say it pays (default 1: a chain)")

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


def add_flags(parser: argparse.ArgumentParser, cls, defaults: dict | None = None) -> None:
    """A flag per field of the dataclass `cls` (--max-batch for max_batch), typed by its default (a bool
    is a switch, a tuple takes several values), with the field's help; `defaults` overrides a default."""
    for f in dataclasses.fields(cls):
        default = (defaults or {}).get(f.name, f.default)
        kw = {k: v for k, v in f.metadata.items()}
        kw.setdefault("help", None)
        name = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(name, action="store_true", default=default, **kw)
        elif isinstance(default, tuple):
            parser.add_argument(name, nargs="+", default=list(default), **kw)
        else:
            typ = type(default) if default is not None else str
            parser.add_argument(name, type=typ, default=default, **kw)
