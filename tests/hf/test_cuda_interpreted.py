"""exactspec.cuda's Triton kernels and the patched transformers path on them (backend 'triton'), run on
the CPU under Triton's interpreter: each kernel bitwise invariant to the rows beside it and to how many
there are, close to a float64 twin; a tiny random Llama gives greedy == assisted == prompt lookup bitwise.
What the interpreter cannot show (the GPU's own dot and exp) bench/gpu_check.py checks on a device."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when exactspec.cuda is imported (triton.jit)
pytest.importorskip("triton", reason="triton is not installed (pip install 'exactspec[cuda]')")
import transformers as tf  # noqa: E402

import exactspec.hf as H  # noqa: E402
from exactspec.cuda import kernels as K  # noqa: E402
from exactspec.errors import InvalidRequest  # noqa: E402
from exactspec.tools.testing import random_model  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not K.INTERPRETED, reason="exactspec.cuda was imported before TRITON_INTERPRET=1")]
tf.logging.set_verbosity_error()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_are_invariant_to_row_count_and_neighbours(dtype):
    x, w, b = randn(17, 100, dtype=dtype), randn(70, 100, dtype=dtype, seed=1), randn(70, seed=2)  # tails in N and K
    full = K.matmul(x, w, b, torch.float32)
    for m in range(1, 18):
        assert torch.equal(K.matmul(x[:m], w, b, torch.float32), full[:m]), m
    other = x.clone()
    other[1:] = randn(16, 100, dtype=dtype, seed=3)
    assert torch.equal(K.matmul(other, w, b, torch.float32)[0], full[0])
    ref = K.matmul_ref(x, w, b)
    assert (full.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert torch.equal(K.matmul(x[:5], w, b)[3], K.matmul(x, w, b)[3])  # stored in x's dtype: invariant too


_AT_ANY_TILE_ROW = """
import os, torch
from exactspec.cuda import kernels as K
assert K.INTERPRETED
for dtype in (torch.float32, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g).to(dtype), torch.randn(64, 64, generator=g).to(dtype)
    full = K.matmul(x, w, None, torch.float32)
    bad = [r for r in range(32) if not torch.equal(K.matmul(x[r:r + 1], w, None, torch.float32)[0], full[r])]
    assert not bad, (dtype, bad)
print("ok")
"""


def test_matmul_row_is_the_same_at_any_tile_row_under_openblas_haswell_kernel():
    """A row alone (tile row 0) and at tile row r of a full tile give the same bits, also where numpy's
    BLAS is OpenBLAS's Haswell kernel, the one every AVX2-only CPU gets: its sgemm rounds a row by its
    place in the tile, so the interpreter's tl.dot (np.matmul) broke a bfloat16 forward there."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENBLAS_CORETYPE": "Haswell"}
    r = subprocess.run([sys.executable, "-c", _AT_ANY_TILE_ROW], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_are_invariant_and_close(dtype):
    x = randn(9, 300, dtype=dtype) * 3
    for fn, ref, tol in ((lambda t: K.rmsnorm(t, 1e-6), lambda t: K.rmsnorm_ref(t, 1e-6), 1e-2),
                         (K.softmax, lambda t: torch.softmax(t.double(), -1), 1e-6),
                         (K.log_softmax, lambda t: torch.log_softmax(t.double(), -1), 1e-5),
                         (lambda t: K.silu_mul(t, torch.float32), K.silu_mul_ref, 1e-5)):
        full = fn(x)
        assert all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(9))
        assert (full.double() - ref(x)).abs().max() < tol * max(1.0, ref(x).abs().max().item())


def causal(T: int, S: int) -> torch.Tensor:
    return (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T))[None]


@pytest.mark.parametrize("dtype", DTYPES[:2])  # float32 math after the load; fp16 loads: the matmul test
def test_attention_rows_are_the_same_in_prefill_decode_verify_padding_and_long_caches(dtype):
    B, Hq, Hkv, T, D = 1, 4, 2, 40, 24  # GQA, a head size that is not a power of 2, 40 keys > 32 (ATTN_BN)
    q, k, v = randn(B, Hq, T, D, dtype=dtype), randn(B, Hkv, T, D, dtype=dtype, seed=1), randn(B, Hkv, T, D, dtype=dtype, seed=2)
    full = K.attention(q, k, v, causal(T, T), 0.3)
    ref = K.attention_ref(q, k, v, causal(T, T), 0.3)
    assert (full.double() - ref).abs().max() < 2e-2
    for t in (0, 17, 31, 32, 39):  # decode: one row over the cache so far
        one = K.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal(1, t + 1), 0.3)
        assert torch.equal(one[:, 0], full[:, t]), t
    for lo, hi in ((0, 5), (20, 37), (33, 40)):  # verify / chunked prefill: rows lo..hi over keys 0..hi
        rows = K.attention(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], causal(hi - lo, hi), 0.3)
        assert torch.equal(rows, full[:, lo:hi]), (lo, hi)
    # a static cache longer than the keys (zeros past them), and left padding beside another sequence
    pad = 11
    kk = torch.cat([randn(2, Hkv, T + pad + 9, D, dtype=dtype, seed=4)])
    kk[0, :, pad:pad + T] = k[0]
    vv = randn(2, Hkv, T + pad + 9, D, dtype=dtype, seed=5)
    vv[0, :, pad:pad + T] = v[0]
    qq = randn(2, Hq, T, D, dtype=dtype, seed=6)
    qq[0] = q[0]
    s, t = torch.arange(T + pad + 9)[None, :], torch.arange(T)[:, None]
    mask = torch.stack([(s >= pad) & (s <= pad + t), s <= t])  # sequence 0 left-padded, 1 not
    both = K.attention(qq, kk, vv, mask, 0.3)
    assert torch.equal(both[0], full[0])


def test_attention_sliding_window_rows_are_the_same_alone_and_close():
    T, W = 45, 11  # each row's keys start at its window's first key, not at position 0
    q, k, v = randn(1, 2, T, 16, dtype=torch.bfloat16), randn(1, 1, T, 16, seed=1), randn(1, 1, T, 16, seed=2)
    k, v = k.bfloat16(), v.bfloat16()
    s, t = torch.arange(T)[None, :], torch.arange(T)[:, None]
    window = ((s <= t) & (s > t - W))[None]
    full = K.attention(q, k, v, window, 0.25)
    assert (full.double() - K.attention_ref(q, k, v, window, 0.25)).abs().max() < 2e-2
    for i in (3, 20, 33, 44):  # a decode row over the whole cache, and over just its window
        assert torch.equal(K.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], window[:, i:i + 1, :i + 1],
                                       0.25)[:, 0], full[:, i])
        lo = max(0, i - W + 1)
        assert torch.equal(K.attention(q[:, :, i:i + 1], k[:, :, lo:i + 1], v[:, :, lo:i + 1], window[:, i:i + 1, lo:i + 1],
                                       0.25)[:, 0], full[:, i])


def test_attention_row_with_no_allowed_key_is_zeros():
    q, k = randn(1, 2, 3, 16), randn(1, 2, 5, 16, seed=1)
    mask = causal(3, 5)
    mask[0, 1] = False
    out = K.attention(q, k, k, mask, 0.25)
    assert torch.equal(out[0, 1], torch.zeros(2, 16)) and out[0, 0].abs().sum() > 0


# --- the patched transformers path, backend 'triton' --------------------------------------------

SMALL = dict(hidden=32, seed_vocab=128)  # the interpreter runs each program in numpy: few programs per forward


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)])
def test_patched_forward_is_close_to_transformers(dtype, tol):
    model = random_model("llama", dtype=dtype, near_ties=False, **SMALL)
    ids = prompt(1, 24)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: the mask must reach the kernel
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits.float()
        with H.patch(model, backend="triton"):
            ours = model(ids, attention_mask=mask).logits.float()
    assert (ours - ref)[:, 5:].abs().max() < tol * ref.abs().max()


def test_patched_bfloat16_logits_are_bitwise_invariant():
    model = random_model("llama", dtype=torch.bfloat16, **SMALL)
    ids = prompt(2, 24)
    with torch.no_grad(), H.patch(model, backend="triton"):
        full = model(ids).logits
        for chunk in (1, 5):  # token by token, in chunks, through transformers' DynamicCache
            cache = tf.DynamicCache(config=model.config)
            rows = [model(ids[:, s:s + chunk], cache=cache, use_cache=True).logits for s in range(0, 24, chunk)]
            assert torch.equal(torch.cat(rows, 1), full), chunk
        other = prompt(3, 30)  # in a left-padded batch beside a longer sequence
        batch = torch.cat([torch.cat([torch.zeros(1, 6, dtype=torch.long), ids], 1), other])
        mask = torch.ones_like(batch)
        mask[0, :6] = 0
        out = model(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert torch.equal(out[0, 6:], full[0])


def test_patched_generate_assisted_and_lookup_equal_greedy():
    target = random_model("llama", dtype=torch.bfloat16, **SMALL)
    draft = random_model("llama", seed=1, dtype=torch.bfloat16, layers=1, **SMALL)
    ids = prompt(5, 12)

    def gen(**kw):
        return target.generate(ids, max_new_tokens=16, min_new_tokens=16, **GREEDY, **kw)

    with H.batch_invariant(target, draft, backend="triton"):
        assert target.config._attn_implementation == H.ATTN_NAME_TRITON
        greedy = gen()
        assert torch.equal(gen(assistant_model=draft), greedy)
        assert torch.equal(gen(prompt_lookup_num_tokens=4), greedy)
    assert not H.is_patched(target) and not H.is_patched(draft)


def test_backend_errors_are_named():
    model = random_model("llama", **SMALL)
    with pytest.raises(InvalidRequest, match="backend 'cuda'.*known: 'numba'"):
        H.patch(model, backend="cuda")
    with H.patch(model, backend="triton"):
        with pytest.raises(InvalidRequest, match="already patched with backend 'triton', not 'numba'"):
            H.patch(model, backend="numba")


def test_every_kernel_configuration_compiles_for_a100_and_h100():
    """The interpreter runs the kernels' logic; Triton's compiler and ptxas (in the triton wheel) build
    their GPU code, no GPU needed: every configuration the wrappers launch at a 7B shape, sm_80 and sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "exactspec.cuda.compile_check", "--arch", "80", "90"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    done = re.search(r"(\d+)/(\d+) kernel configurations compiled", r.stdout)
    assert done and done[1] == done[2] and int(done[1]) >= 100, r.stdout
