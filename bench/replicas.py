"""Replicas on Ray Serve: one replica with 2 threads vs 2 replicas with 1 thread each, the same total
CPUs, the same requests, on a local Ray cluster (loopback).

    python bench/replicas.py [--model PATH] [--clients 8] [--requests 4] [--max-tokens 48]

Prints per configuration: requests/s and generated tokens/s, request latency p50/p99, and whether
every answer is identical to the same request in the other configuration (and to the first
configuration's own answer when repeated): a request's tokens never depend on which replica, batch
or thread count served it. Default model: the demo's SmolLM2-135M Q4_1 GGUF (or the toy pair).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import time

import httpx
import openai
import ray
from ray import serve

import exactspec
from exactspec.serve import ray as exact_ray
from exactspec.serve.options import ServeOptions
from common import default_model, table
from load import PROMPTS


def ask(client: openai.OpenAI, i: int, max_tokens: int) -> tuple[str, int, float]:
    t = time.perf_counter()
    r = client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                  temperature=0.0 if i % 2 else 0.8, seed=i, extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.completion_tokens, time.perf_counter() - t


def warm(url: str, replicas: int) -> None:
    """Small requests until every replica has answered one (its kernels compiled and warm)."""
    seen: set[str] = set()
    with cf.ThreadPoolExecutor(replicas) as pool:
        while len(seen) < replicas:
            rs = pool.map(lambda _: httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi",
                                                                            "max_tokens": 4}, timeout=600),
                          range(replicas))
            seen |= {r.headers["x-exactspec-replica"] for r in rs}


def measure(url: str, replicas: int, clients: int, requests: int, max_tokens: int) -> dict:
    warm(url, replicas)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=600)
    n = clients * requests
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(lambda i: ask(client, i, max_tokens), range(n)))
    wall = time.perf_counter() - t
    lat = sorted(g[2] for g in got)
    return {"texts": [g[0] for g in got], "rps": n / wall, "tps": sum(g[1] for g in got) / wall,
            "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    path = default_model(a.model)
    model = exactspec.load(path)
    print(f"model: {path} ({model.net.dtype}); {a.clients} clients x {a.requests} requests, {a.max_tokens} tokens")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    port = 8790
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    opts = ServeOptions(max_batch=8)
    results = {}
    try:
        for label, scaling in (("1 replica x 2 threads", exact_ray.Scaling(1, cpus_per_replica=2)),
                               ("2 replicas x 1 thread", exact_ray.Scaling(2, cpus_per_replica=1))):
            serve.run(exact_ray.application(model, "m", None, 4, opts, scaling), name="exactspec", route_prefix="/")
            results[label] = measure(f"http://127.0.0.1:{port}", scaling.replicas, a.clients, a.requests, a.max_tokens)
            serve.delete("exactspec")
    finally:
        serve.shutdown()
        ray.shutdown()
    (la, ra), (lb, rb) = results.items()
    same = ra["texts"] == rb["texts"]
    table(["configuration", "req/s", "tok/s", "p50 s", "p99 s"],
          [[k, f"{r['rps']:.2f}", f"{r['tps']:.1f}", f"{r['p50']:.2f}", f"{r['p99']:.2f}"] for k, r in results.items()])
    print(f"2 replicas / 1 replica throughput: {rb['tps'] / ra['tps']:.2f}x")
    print(f"identical across replicas and configurations: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
