"""The server's Prometheus metrics (/metrics): request counts by route template, tokens, latency,
time to first token, and the engine's live figures."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import Engine


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exactspec_requests", "HTTP requests by route (template, not raw path) and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("exactspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated = Counter("exactspec_generated_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("exactspec_request_latency_seconds", "Request latency", registry=r,
                                 buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("exactspec_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        Gauge("exactspec_running_sequences", "Sequences in the running batch", registry=r).set_function(
            lambda: engine.running)
        Gauge("exactspec_queued_requests", "Requests waiting for a slot", registry=r).set_function(
            lambda: engine.queued)
        Gauge("exactspec_draft_proposed_tokens", "Draft tokens proposed (finished requests)", registry=r).set_function(
            lambda: engine.stats.proposed)
        Gauge("exactspec_draft_accepted_tokens", "Draft tokens accepted (finished requests)", registry=r).set_function(
            lambda: engine.stats.accepted)
        Gauge("exactspec_cancelled_requests", "Requests ended early (disconnect, stop string)",
              registry=r).set_function(lambda: engine.stats.cancelled)
        Gauge("exactspec_cancelled_tokens", "Tokens generated for requests that were then cancelled",
              registry=r).set_function(lambda: engine.stats.cancelled_tokens)
        Gauge("exactspec_failed_requests", "Requests ended by an internal error (see the log by error id)",
              registry=r).set_function(lambda: engine.stats.failed)
        Gauge("exactspec_engine_alive", "1 while the decoding engine thread runs", registry=r).set_function(
            lambda: float(engine.alive))
        def prefix(attr: str):
            return lambda: getattr(engine.batch.prefix, attr) if engine.batch.prefix is not None else 0
        Gauge("exactspec_prefix_cache_hit_tokens", "Prompt tokens whose keys came from the prefix cache",
              registry=r).set_function(prefix("hit_tokens"))
        Gauge("exactspec_prefix_cache_queried_tokens", "Prompt tokens of the requests that looked in the prefix cache",
              registry=r).set_function(prefix("looked_up_tokens"))
        Gauge("exactspec_prefix_cache_blocks", "KV blocks the prefix cache keeps", registry=r).set_function(
            prefix("blocks"))
        Gauge("exactspec_kv_blocks_used", "KV blocks in use (sequences and the prefix cache; the global "
              "layers' pool)", registry=r).set_function(lambda: engine.batch.cache.blocks_used)
        Gauge("exactspec_kv_block_bytes", "Bytes of one KV block (16 positions, every layer)", registry=r).set_function(
            lambda: engine.batch.target.block_bytes)
        Gauge("exactspec_kv_resident_bytes", "KV bytes of the blocks in use, both pools (sliding-window layers "
              "keep only their window's)", registry=r).set_function(lambda: engine.batch.cache.bytes_used)
        Gauge("exactspec_engine_step_seconds", "Engine thread: time in decode steps (forward, drafting, sampling)",
              registry=r).set_function(lambda: engine.stats.step_seconds)
        Gauge("exactspec_engine_other_seconds", "Engine thread: time between steps (admission, handing out tokens)",
              registry=r).set_function(lambda: engine.stats.other_seconds)
        Gauge("exactspec_acceptance_rate", "Accepted / proposed draft tokens", registry=r).set_function(
            lambda: engine.stats.accepted / engine.stats.proposed if engine.stats.proposed else 0.0)
