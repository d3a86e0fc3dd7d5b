"""Exact replicas on Ray Serve: a local Ray cluster (loopback, 2 CPUs) serving 2 replicas of a tiny
model, 1 thread each, answers every request exactly as one plain server does (text, finish reason,
token logprobs to the bit; streaming and not), and keeps doing so when a replica is killed mid-run
(the client retries; Serve replaces the replica)."""
import concurrent.futures as cf
import os
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional [ray] extra: pip install 'exactspec[ray]'")
serve = pytest.importorskip("ray.serve")

import exactspec  # noqa: E402
from exactspec.serve import ray as exact_ray  # noqa: E402
from exactspec.decode.drafters import LookupDrafter  # noqa: E402
from exactspec.serve.options import ServeOptions  # noqa: E402
from tests.serve.serving import InProcess, free_port  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and replicas

OPTS = ServeOptions(max_batch=4)
PROMPTS = ["The quick brown fox", "1 2 3 4 5 6", "hello hello hello", "a b c", "Once upon a time there was"]


def _asks():
    """(kind, kwargs): greedy and seeded sampling, completions and chat."""
    out = []
    for i, p in enumerate(PROMPTS):
        out.append(("completion", dict(prompt=p, max_tokens=24, temperature=0, logprobs=2)))
        out.append(("completion", dict(prompt=p, max_tokens=24, temperature=0.9, top_p=0.9, seed=i, logprobs=1)))
    out.append(("chat", dict(messages=[{"role": "user", "content": "Say something."}], max_tokens=20, seed=5,
                             temperature=0.8)))
    return out


def _ask(client: openai.OpenAI, kind: str, kw: dict, stream: bool = False):
    """What must be identical: text, finish reason, token logprobs (floats, to the bit)."""
    if kind == "chat":
        if stream:
            parts = list(client.chat.completions.create(model="tiny", stream=True, **kw))
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices), \
                [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
        r = client.chat.completions.create(model="tiny", **kw)
        return r.choices[0].message.content, [r.choices[0].finish_reason]
    if stream:
        parts = list(client.completions.create(model="tiny", stream=True, **kw))
        return "".join(c.choices[0].text for c in parts if c.choices), \
            [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
    r = client.completions.create(model="tiny", **kw)
    c = r.choices[0]
    return c.text, [c.finish_reason], c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs


@pytest.fixture(scope="module")
def plain(folder):
    """The reference: one plain server (no Ray), 2 threads."""
    s = InProcess(folder, OPTS, drafter=LookupDrafter(), num_draft_tokens=3)
    s.gate.open.set()
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield {(kind, str(kw), stream): _ask(client, kind, kw, stream) for kind, kw in _asks()
           for stream in (False, True)}
    s.stop()


@pytest.fixture(scope="module")
def cluster(folder):
    # Serve's controller kills an HTTP proxy that is not ready in 5 s (then serve.start fails): on two busy
    # cores (the other xdist worker compiling) a new proxy process can take longer than that to start.
    # Inherited by the processes ray.init starts.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             namespace="exactspec-test")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = exactspec.load(folder)
    app = exact_ray.application(model, "tiny", "lookup", 3, OPTS, exact_ray.Scaling(replicas=2, cpus_per_replica=1))
    serve.run(app, name="exactspec", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::exactspec#")]


def test_every_replica_answers_as_one_plain_server(plain, cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=2, timeout=120)
    asks = [(kind, kw, stream) for kind, kw in _asks() for stream in (False, True)]
    with cf.ThreadPoolExecutor(4) as pool:  # concurrent: both replicas busy, batches mixed
        got = list(pool.map(lambda a: _ask(client, *a), asks * 2))
    for (kind, kw, stream), g in zip(asks * 2, got):
        assert g == plain[(kind, str(kw), stream)], (kind, kw, stream)
    assert len(_replicas()) == 2, _replicas()
    # the proxy spreads requests over both replicas: concurrent ones (idle replicas tie, and Serve's router
    # may then keep picking one: seen once in CI with 40 sequential requests), for up to 30 s
    seen, deadline = set(), time.time() + 30
    with cf.ThreadPoolExecutor(8) as pool:
        while len(seen) < 2 and time.time() < deadline:
            seen |= set(pool.map(lambda _: httpx.get(cluster + "/health", timeout=30).headers["x-exactspec-replica"],
                                 range(32)))
    assert len(seen) == 2, seen
    assert httpx.get(cluster + "/health", timeout=30).json()["engine_alive"] is True


def test_a_replica_killed_mid_run_changes_no_answer(plain, cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=8, timeout=120)
    asks = [(kind, kw, stream) for kind, kw in _asks() for stream in (False,)] * 3
    victims = _replicas()
    assert len(victims) == 2
    with cf.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_ask, client, *a) for a in asks]
        time.sleep(1.0)  # requests in flight on both replicas
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
        got = [f.result() for f in futures]  # each one retried by the client until it succeeds
    for (kind, kw, stream), g in zip(asks, got):
        assert g == plain[(kind, str(kw), stream)], (kind, kw)
    deadline = time.time() + 60  # Serve replaces the dead replica
    while not (len(_replicas()) == 2 and victims[0] not in _replicas()):
        assert time.time() < deadline, _replicas()
        time.sleep(0.5)
