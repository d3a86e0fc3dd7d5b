"""Many replicas behind one endpoint: exactspec's OpenAI server as a Ray Serve deployment.

    pip install 'exactspec[ray]'
    exactspec serve --model M --ray --replicas 2 --cpus-per-replica 1            # a local Ray cluster
    exactspec serve --model M --ray --ray-address auto --replicas 8 --max-replicas 16  # an existing one

Each replica is one `server.Server` (one engine, the same routes, limits and errors) mounted as the
deployment's ASGI app through Serve's ingress; Serve's proxy routes requests among replicas and
replaces one whose health check (the engine's liveness) fails. A request's tokens depend on its
prompt and seed only (never on the batch it shares, the thread count or the CPU), so every replica
answers every request the same: a client may retry anywhere.

Weights: the model is loaded once, by the process that builds the application, and put in Ray's
object store; each node holds one copy in shared memory and its replicas read it in place (numpy
arrays from the object store are zero-copy, read-only views), so N replicas on a node cost one
model's memory plus their KV caches.

Under Serve, Ray's proxy owns the connections: ServeOptions' connection limits and timeouts
(max_connections, keep_alive, read_timeout) are the proxy's business there; the per-request limits
(body size, stops, prompt, API key, queue) are enforced by each replica as in `exactspec serve`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import ray
from ray import serve

from ..api import Model
from ..decode.drafters import is_named
from ..kernels import set_num_threads
from .app import Server
from .options import ServeOptions


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and what each gets. max_replicas > replicas turns on Serve's autoscaling
    (between the two, by ongoing requests per replica)."""
    replicas: int = 1
    max_replicas: int | None = None
    cpus_per_replica: float = 1.0  # Ray CPUs reserved per replica; also its kernel threads

    @property
    def threads(self) -> int:
        return max(1, int(self.cpus_per_replica))

    def deployment_options(self, opts: ServeOptions) -> dict:
        # The replica's thread pools sized before numba and torch start: a pool wider than the replica's
        # CPUs would spin on the cores of the replica beside it.
        env = {"NUMBA_NUM_THREADS": str(self.threads), "OMP_NUM_THREADS": str(self.threads)}
        o = dict(ray_actor_options={"num_cpus": self.cpus_per_replica, "runtime_env": {"env_vars": env}},
                 health_check_period_s=2,
                 health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
                 max_ongoing_requests=opts.max_batch + opts.max_queue)
        if self.max_replicas and self.max_replicas > self.replicas:
            o["autoscaling_config"] = {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": opts.max_batch}
        else:
            o["num_replicas"] = self.replicas
        return o


@serve.ingress()
class Replica:
    """One engine and its OpenAI routes. `shared` holds object-store references (not resolved by Ray
    on the way in, so this replica reads the node's copy): the target, and the draft Model if any."""

    def __init__(self, shared: dict, name: str, draft: str | None, num_draft_tokens: int | str,
                 opts: ServeOptions, threads: int):
        set_num_threads(threads)
        model: Model = ray.get(shared["model"])
        drafter = None
        if is_named(draft):
            drafter = model.make_drafter(draft)
        elif shared.get("draft") is not None:
            drafter = model.make_drafter(ray.get(shared["draft"]))
        self.server = Server(model, name, drafter, num_draft_tokens, opts)

    def __serve_build_asgi_app__(self):
        return _Tagged(self.server.app, serve.get_replica_context().replica_id.unique_id.encode())

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped is replaced."""
        if not self.server.engine.alive:
            raise RuntimeError("exactspec engine stopped")

    def __del__(self):
        self.server.engine.stop()


class _Tagged:
    """ASGI middleware: every response says which replica answered (`x-exactspec-replica`)."""

    def __init__(self, app, tag: bytes):
        self.app, self.tag = app, tag

    async def __call__(self, scope, receive, send):
        async def tagged(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-exactspec-replica", self.tag)]}
            await send(msg)
        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


def application(model: Model, name: str, draft: Model | str | None = None, num_draft_tokens: int | str = "auto",
                opts: ServeOptions = ServeOptions(), scaling: Scaling = Scaling()) -> serve.Application:
    """The deployment, bound: `serve.run(application(...))` starts it on the connected Ray cluster.
    draft: a draft Model, "lookup" (prompt lookup), "pool" (lookup + the n-gram pool), or None."""
    shared = {"model": ray.put(model)}
    if isinstance(draft, Model):
        shared["draft"] = ray.put(draft)
        draft = None
    dep = serve.deployment(Replica, name="exactspec", **scaling.deployment_options(opts))
    return dep.bind(shared, name, draft, num_draft_tokens, opts, scaling.threads)


def run(model: Model, name: str, host: str, port: int, draft: Model | str | None, num_draft_tokens: int | str,
        opts: ServeOptions, scaling: Scaling, address: str | None = None) -> None:
    """`exactspec serve --ray`: connect to (or start) a Ray cluster, serve until interrupted."""
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(model, name, draft, num_draft_tokens, opts, scaling), name="exactspec", route_prefix="/")
    print(f"exactspec: serving {name} ({model.folder}) with Ray Serve on http://{host}:{port}/v1", file=sys.stderr,
          flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()
