"""kv_dtype="bfloat16": keys and values stored as bfloat16, each rounded once when written (to nearest,
ties to even, as torch's .to(bfloat16)) and widened exactly when read. So the attention is bitwise the
float32 cache's attention over the rounded values, a position's stored keys are still a function of its
prefix (every invariance holds), the memory halves, and the logits stay close to the float32 cache's."""
import numpy as np
import pytest
import torch
from numba import njit

import exactspec
from exactspec import kernels as K
from exactspec.decode.loop import Batch
from exactspec.kernels.attention import kv_load, kv_store
from exactspec.model.cache import KVCache


@njit(cache=False)
def _store_all(x, out):
    for i in range(x.shape[0]):
        out[i] = kv_store(x[i], out)


@njit(cache=False)
def _load_all(b, out):
    for i in range(b.shape[0]):
        out[i] = kv_load(b[i])


def test_store_rounds_as_torch_and_load_widens_exactly():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:8] = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x00008000, 0x80018000, 0x7F800000, 0xFF800000]
    x = bits.view(np.float32)  # ties (even and odd), the largest finite, subnormals, infinities, random
    got = np.empty(x.shape[0], np.uint16)
    _store_all(x, got)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = np.empty(x.shape[0], np.float32)
    _load_all(got, back)
    assert np.isnan(back[nan]).all()
    assert np.array_equal(back[~nan], torch.from_numpy(want[~nan].view(np.int16)).view(torch.bfloat16).float().numpy())
    assert kv_store(np.float32(1.00390625), np.empty(1, np.uint16)) == 0x3F80  # the Python twins agree
    assert kv_load(np.uint16(0x3F81)) == np.float32(1.0078125)


def test_bfloat16_cache_attention_is_the_float32_cache_of_the_rounded_values():
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D, R = 4, 2, 16, 37
    qkv = torch.randn(R, (Hq + 2 * Hkv) * D, generator=g)
    cos, sin = K.rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 64)
    slot, pos = torch.zeros(R, dtype=torch.int64), torch.arange(R)
    out = {}
    for kv in ("float32", "bfloat16"):
        c = KVCache(1, 1, Hkv, D, 64, kv_dtype=kv)
        c.reserve(slot.numpy(), pos.numpy())
        q = K.qkv_rope_cache(qkv, Hq, Hkv, D, np.empty(0, np.float32), np.empty(0, np.float32), 1e-6, cos, sin,
                             c.table, slot, pos, c.k[0], c.v[0])
        out[kv] = (q, c)
    q, c32 = out["float32"]
    _, c16 = out["bfloat16"]
    assert c16.k.dtype == torch.bfloat16 and c16.k.element_size() * 2 == c32.k.element_size()
    (k16, v16), (k32, v32) = c16.gather(0, R), c32.gather(0, R)  # the positions written, as float32
    assert torch.equal(k16, k32.to(torch.bfloat16).float()) and torch.equal(v16, v32.to(torch.bfloat16).float())
    c32.k.copy_(c32.k.to(torch.bfloat16).float())
    c32.v.copy_(c32.v.to(torch.bfloat16).float())
    a32 = K.attention(q, c32.k[0], c32.v[0], c32.table, slot, pos, 0.25)
    a16 = K.attention(q, c16.k[0], c16.v[0], c16.table, slot, pos, 0.25)
    assert torch.equal(a16, a32)


@pytest.fixture(scope="module")
def bf16kv(ckpt):
    return exactspec.load(ckpt("qwen3"), kv_dtype="bfloat16")


def test_every_invariance_holds_with_a_bfloat16_cache(bf16kv, ckpt):
    m = bf16kv
    prompts = [list(range(3, 60)), [5, 6, 7], [100, 3, 100, 3, 9] * 4]
    kw = dict(ignore_eos=True, temperature=0.8, seed=4, logprobs=1)
    solo = [m.generate(p, 24, **kw) for p in prompts]
    want = [(r.token_ids, [x.logprob for x in r.logprobs]) for r in solo]
    for draft in (None, "lookup"):
        got = m.generate_batch(prompts, 24, draft=draft, num_draft_tokens=3, **kw)
        assert [(r.token_ids, [x.logprob for x in r.logprobs]) for r in got] == want, draft
    exactspec.set_num_threads(1)
    try:
        assert m.generate(prompts[0], 24, **kw).token_ids == want[0][0]
    finally:
        exactspec.set_num_threads(2)
    b = Batch(m.net, 2, 128, None, prefill_chunk=5, prefix_blocks=8)  # chunked, then a cached prefix
    for p, w in ((prompts[0], want[0][0]), (prompts[0][:40] + [9, 9], None), (prompts[0], want[0][0])):
        s = b.add(m.request(p, 24, **kw))
        while b.running:
            b.step()
        if w is not None:
            assert s.generated == w
    assert s.stats.cached_tokens > 0
    m32 = exactspec.load(ckpt("qwen3"))
    assert m.net.block_bytes * 2 == m32.net.block_bytes
    l16, l32 = m.logits(prompts[0]), m32.logits(prompts[0])
    assert not torch.equal(l16, l32) and (l16 - l32).abs().max() < 0.05  # one rounding of each key and value


def test_bad_kv_dtype_is_named(ckpt):
    with pytest.raises(exactspec.UnsupportedModelError, match="kv_dtype='float16' is not supported"):
        exactspec.load(ckpt("llama"), kv_dtype="float16")
