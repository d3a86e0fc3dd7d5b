"""The prefix cache through the server: concurrent requests sharing a system prompt, with prompt
lookup speculation and sampling, answer bitwise as with the cache off; hits are reported in
usage.prompt_tokens_details.cached_tokens and /metrics; a cache_salt (or, with
--prefix-cache-scope authorization, the API key) keeps tenants apart."""
import concurrent.futures as cf

import httpx
import numpy as np

from exactspec.decode.drafters import LookupDrafter
from exactspec.kernels import BLOCK
from exactspec.serve.options import ServeOptions

SYSTEM = "You are a careful assistant. Answer in one short line, and never repeat the question. " * 3


def _bodies():
    out = []
    for i, q in enumerate(["What is 2 + 2?", "Name a colour.", "def add(a, b):", "Say hi.", "Count to five."]):
        out.append(dict(prompt=SYSTEM + q, max_tokens=20, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                        logprobs=1))
    return out


def _post(url, body, headers=None):
    r = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_sharers_equal_cache_off(serve, model):
    texts, cached = {}, {}
    for mb in (0, 64):
        s = serve(ServeOptions(prefix_cache_mb=mb, max_batch=3), drafter=LookupDrafter(), num_draft_tokens=3)
        _post(s.url, dict(prompt=SYSTEM + "Hello.", max_tokens=2))  # the system prompt's blocks, cached
        with cf.ThreadPoolExecutor(5) as ex:
            got = list(ex.map(lambda b: _post(s.url, b), _bodies()))
        texts[mb] = [(g["choices"][0]["text"], g["choices"][0]["logprobs"]["token_logprobs"]) for g in got]
        cached[mb] = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        metrics = httpx.get(s.url + "/metrics").text
        s.stop()
    assert texts[64] == texts[0]
    assert cached[0] == [0] * 5
    n_sys = len(model.encode(SYSTEM))
    assert all(c >= (n_sys // BLOCK) * BLOCK > 0 for c in cached[64]), cached
    def metric(name):
        return next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(name + " "))
    assert metric("exactspec_prefix_cache_hit_tokens") >= sum(cached[64])
    held = metric("exactspec_prefix_cache_blocks")  # nothing runs now: the kept blocks are all that is in use
    assert held > 0 and metric("exactspec_kv_resident_bytes") == held * metric("exactspec_kv_block_bytes")


def test_salt_and_authorization_scopes(serve):
    s = serve(ServeOptions(prefix_cache_scope="authorization"))
    body = dict(prompt=SYSTEM + "Hi.", max_tokens=2, temperature=0)

    def hit(headers=None, **kw):
        return _post(s.url, dict(body, **kw), headers)["usage"]["prompt_tokens_details"]["cached_tokens"]
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    assert hit(alice) == 0
    assert hit(alice) > 0
    assert hit(bob) == 0  # another tenant: no hit, so no timing signal about alice's prompts
    assert hit(alice, cache_salt="x") == 0 and hit(alice, cache_salt="x") > 0
    assert httpx.post(s.url + "/v1/completions", json=dict(body, cache_salt=5)).status_code == 400


class ShiftedLookup(LookupDrafter):
    """Prompt lookup whose first draft token is moved one id on; lookup's own guess is its runner-up (tree
    verification then wins exactly where lookup would have been right)."""

    def propose(self, slots, seqs, ks, params):
        out = super().propose(slots, seqs, ks, params)
        self.alts = {s: d[:1] for s, d in zip(slots, out)}
        return [[(d[0] + 1) % 256] + d[1:] if d else d for d in out]

    def alternatives(self, slot):
        return self.alts.get(slot, [])


def test_tree_verification_through_the_server(serve, monkeypatch):
    """--draft-branches reaches the engine's batch; siblings verified and won beside the prefix cache and
    concurrent requests change no text, logprob or cached-token count."""
    from exactspec.decode import loop
    from exactspec.model.cache import KVCache
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: np.ones(17))  # every sibling pays
    swaps, swap = [], KVCache.swap
    monkeypatch.setattr(KVCache, "swap", lambda self, *a: (swaps.append(a), swap(self, *a)))
    texts, cached = {}, {}
    for branches in (1, 2):
        s = serve(ServeOptions(max_batch=3, draft_branches=branches), drafter=ShiftedLookup(), num_draft_tokens=3)
        _post(s.url, dict(prompt=SYSTEM + "Hello.", max_tokens=2))
        with cf.ThreadPoolExecutor(5) as ex:
            got = list(ex.map(lambda b: _post(s.url, b), _bodies()))
        texts[branches] = [(g["choices"][0]["text"], g["choices"][0]["logprobs"]["token_logprobs"]) for g in got]
        cached[branches] = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        assert s.srv.engine.batch.branches == branches
        s.stop()
        assert (len(swaps) > 0) == (branches > 1)  # siblings won (their blocks swapped in) with branches only
    assert texts[2] == texts[1] and cached[2] == cached[1]
