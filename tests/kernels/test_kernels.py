"""Kernels against their plain twins, and invariance of each kernel by itself."""
import math

import pytest
import numpy as np
import torch
import torch.nn.functional as F

from exactspec import kernels as K
from exactspec.hf.attention import masked_attention


def _w(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 64), (130, 70), (200, 33), (7, 5)])
def test_linear_matches_twin_bitwise(dtype, n, k):
    w = _w(n, k, dtype)
    b = torch.randn(n)
    x = torch.randn(11, k)
    for bias in (None, b):
        p = K.pack_weight(w, bias)
        assert torch.equal(p.unpack(), w.float())
        assert torch.equal(K.linear(x, p), K.linear_ref(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_independent_of_rows_in_call_and_threads(dtype):
    w = _w(300, 96, dtype)
    p = K.pack_weight(w)
    x = torch.randn(40, 96)
    alone = torch.cat([K.linear(x[i:i + 1], p) for i in range(40)])
    for M in [2, 3, 4, 5, 8, 9, 16, 17, 40]:
        assert torch.equal(K.linear(x[:M], p), alone[:M]), M
    perm = torch.randperm(40)
    assert torch.equal(K.linear(x[perm], p), alone[perm])
    assert 1 * 300 * 96 < K.SERIAL_WORK < 40 * 300 * 96  # rows above crossed the serial/parallel switch
    K.set_num_threads(1)
    try:
        one = K.linear(x, p)
    finally:
        K.set_num_threads(2)
    assert torch.equal(one, alone)


def test_linear_close_to_float64():
    w = _w(256, 512, torch.float32)
    x = torch.randn(5, 512)
    ref = (x.double() @ w.double().T).float()
    assert torch.allclose(K.linear(x, K.pack_weight(w)), ref, atol=1e-5, rtol=1e-5)


def test_torch_linear_is_not_batch_invariant_here():
    """The problem we solve, on the pinned torch build (docs/exactness.md): F.linear of the same
    row depends on how many rows share the call (gemv for M=1, gemm blockings for M>1). This is what gives the invariance tests below their teeth: if torch ever stops
    showing it, this fails and the contrast must be found elsewhere."""
    torch.manual_seed(0)
    w = torch.randn(2048, 1024)
    x = torch.randn(16, 1024)
    one = F.linear(x[:1], w)
    differs = [M for M in range(2, 17) if not torch.equal(F.linear(x[:M], w)[:1], one)]
    assert differs, f"torch {torch.__version__} F.linear gave row 0 the same bits for M = 1..16 on this CPU"


def test_rmsnorm_matches_twin_and_rows():
    x = torch.randn(33, 96)
    w = torch.randn(96)
    y = K.rmsnorm(x, w.numpy(), 1e-6)
    assert torch.equal(y, K.rmsnorm_ref(x, w, 1e-6))
    assert torch.equal(K.rmsnorm(x[5:6], w.numpy(), 1e-6), y[5:6])


def test_silu_mul_close_and_position_independent():
    gu = torch.randn(9, 2 * 37) * 4
    y = K.silu_mul(gu)
    assert torch.allclose(y, K.silu_mul_ref(gu), atol=1e-6, rtol=1e-5)
    for i in range(9):
        assert torch.equal(K.silu_mul(gu[i:i + 1]), y[i:i + 1])


def test_exp_does_not_depend_on_buffer_position():
    """Vector body vs scalar tail: the same value must get the same exp wherever it sits."""
    v = torch.randn(1, 1000) * 10
    full = K.softmax(v)
    for shift in [1, 3, 7, 8, 15, 17]:
        w = torch.cat([torch.full((1, shift), -1e30), v], dim=1)
        part = K.softmax(w)[:, shift:]
        assert torch.equal(part, full), shift  # -1e30 pads add exact zeros to the sum


def test_softmax_log_softmax_close():
    x = torch.randn(4, 500) * 3
    x[1, 7] = float("-inf")
    assert torch.allclose(K.softmax(x), torch.softmax(x, -1), atol=1e-7, rtol=1e-5)
    ls = K.log_softmax(x)
    assert torch.allclose(ls[:, :7], torch.log_softmax(x, -1)[:, :7], atol=1e-5)
    assert ls[1, 7] == float("-inf")


def test_cumsum_sequential():
    x = torch.rand(1000)
    y = K.cumsum(x)
    for i in range(0, 1000, 97):
        s = K.cumsum(x[: i + 1])[-1]
        assert torch.equal(s, y[i])


def _cache_with(k, v, cap, slot, n_slots, seed=0):
    """A paged cache of n_slots x cap positions, garbage everywhere but `slot`'s first T positions,
    whose blocks sit in the pool in a shuffled order: (kt, vc, table)."""
    T, Hkv, D = k.shape
    B = K.BLOCK
    nb = -(-cap // B)
    order = torch.randperm(n_slots * nb, generator=torch.Generator().manual_seed(seed))
    table = order.view(n_slots, nb).to(torch.int32).numpy()
    kt = torch.randn(Hkv, n_slots * nb, D, B)
    vc = torch.randn(Hkv, n_slots * nb, B, D)
    for j in range(T):
        b, o = table[slot, j // B], j % B
        kt[:, b, :, o] = k[j]
        vc[:, b, o] = v[j]
    return kt, vc, table


@pytest.mark.parametrize("window", [0, 5])
def test_attention_close_to_reference_and_invariant(window):
    torch.manual_seed(1)
    T, Hq, Hkv, D = 60, 4, 2, 32
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    ref = K.attention_ref(q, k, v, 0.25, window)
    kt, vc, table = _cache_with(k, v, 64, 0, 1)
    pos = torch.arange(T)
    out = K.attention(q, kt, vc, table, torch.zeros(T, dtype=torch.long), pos, 0.25, window)
    assert torch.allclose(out, ref, atol=1e-5)
    # same rows, bigger cache, another slot, blocks elsewhere in the pool, alone and shuffled: identical bits
    kt2, vc2, table2 = _cache_with(k, v, 100, 2, 3, seed=1)
    assert 1 * Hq * D * 2 < K.SERIAL_WORK < T * Hq * D * T * 2  # both builds of the kernel run below
    for r in [0, 5, 59]:
        one = K.attention(q[r:r + 1], kt2, vc2, table2, torch.tensor([2]), pos[r:r + 1], 0.25, window)
        assert torch.equal(one, out[r:r + 1])
    perm = torch.randperm(T)
    assert torch.equal(K.attention(q[perm], kt2, vc2, table2, torch.full((T,), 2), pos[perm], 0.25, window),
                       out[perm])


def _causal(T: int, window: int) -> torch.Tensor:
    """(T, T) bool: row i may attend keys j <= i (and > i - window)."""
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] > i[:, None] - window
    return mask


@pytest.mark.parametrize("window", [0, 16])
def test_masked_attention_equals_the_engine_kernel_and_ignores_masked_keys(window):
    """transformers-layout attention (exactspec.hf): a row's bits equal the engine kernel's for the
    same visible keys, and keys it may not attend (even NaN/inf ones, padding) never touch it."""
    torch.manual_seed(2)
    T, Hq, Hkv, D = 40, 4, 2, 32
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    kt, vc, table = _cache_with(k, v, 64, 0, 1)
    want = K.attention(q, kt, vc, table, torch.zeros(T, dtype=torch.long), torch.arange(T), 0.25, window)
    mask = _causal(T, window)
    hq, hk, hv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    got = masked_attention(hq, hk, hv, mask[None].to(torch.uint8).numpy(), 0.25)[0]
    assert torch.equal(got, want)
    # left padding of 7 junk keys, and a batch of two rows with different pads: same bits
    pad = 7
    junk = torch.full((1, Hkv, pad, D), float("nan"))
    pk, pv = torch.cat([junk, hk], 2), torch.cat([junk.clone().fill_(float("inf")), hv], 2)
    pmask = torch.cat([torch.zeros(T, pad, dtype=torch.bool), mask], 1)
    pq = hq[:, :, -5:]
    out = masked_attention(pq, pk, pv, pmask[None, -5:].to(torch.uint8).numpy(), 0.25)[0]
    assert torch.equal(out, want[-5:])
    empty = masked_attention(pq, pk, pv, np.zeros((1, 5, T + pad), np.uint8), 0.25)
    assert torch.equal(empty, torch.zeros_like(empty))  # a row that may attend nothing: zeros, not NaN


@pytest.mark.parametrize("D", [24, 32, 80])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5, 21])
@pytest.mark.parametrize("heads", [(4, 2), (5, 5), (7, 1), (24, 2)])
def test_vector_attention_gives_the_bits_of_the_scalar_loops(D, kv, window, heads):
    """The engine kernel's vector code (kernels/attnvec.py: 16 keys of a block per vector, 4 chains side by
    side, values in chunks of 16 d's, up to 8 queries (rows x query heads of one KV head) sharing each
    load) computes the scalar loops' operations lane by lane: the transformers-layout kernel runs those
    loops (one block of any size, under a mask), and the two agree bitwise for 1..5 blocks, partial first
    and last blocks (windows: queries of a task with different spans), 1..5 chunks of d (80), a bfloat16
    cache, D = 24 (no vector path), 1..8 queries a task (heads 4/2: 2 a row, 5/5: 1, 7/1: 7, 24/2: 8 then
    4); and a row's
    bits do not depend on which rows share its call (how rows are grouped into tasks)."""
    torch.manual_seed(3)
    T, (Hq, Hkv) = 75, heads
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    k, v = k.to(kv).float(), v.to(kv).float()  # the values a bfloat16 cache holds
    kt, vc, table = _cache_with(k, v, 80, 1, 2)
    kt, vc = kt.to(kv), vc.to(kv)
    pos = torch.arange(T)
    got = K.attention(q, kt, vc, table, torch.ones(T, dtype=torch.long), pos, 0.25, window)
    mask = _causal(T, window)
    hq, hk, hv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    want = masked_attention(hq, hk, hv, mask[None].to(torch.uint8).numpy(), 0.25)[0]
    assert torch.equal(got, want)
    assert torch.allclose(got, K.attention_ref(q, k, v, 0.25, window), atol=1e-5)
    for a, b in [(0, 1), (74, 75), (3, 6), (17, 30), (40, 49)]:  # other groupings (a lone row: a task per head)
        part = K.attention(q[a:b], kt, vc, table, torch.ones(b - a, dtype=torch.long), pos[a:b], 0.25, window)
        assert torch.equal(part, got[a:b])


def test_rope_table_entries_do_not_depend_on_length():
    f = torch.rand(8)
    c1, s1 = K.rope_table(f, 37)
    c2, s2 = K.rope_table(f, 100)
    assert torch.equal(c1, c2[:37]) and torch.equal(s1, s2[:37])
    p = torch.arange(100).float()[:, None] * f
    assert torch.allclose(c2[:, :8], p.cos(), atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_cache_matches_torch_rotate_half_bitwise(qk_norm):
    torch.manual_seed(2)
    R, Hq, Hkv, D, C = 5, 4, 2, 8, 20
    qkv = torch.randn(R, (Hq + 2 * Hkv) * D)
    cos, sin = K.rope_table(torch.rand(D // 2), C)
    pos, slot = torch.tensor([0, 3, 4, 9, 19]), torch.tensor([1, 0, 1, 1, 0])
    qn, kn = (torch.rand(D) + 0.5, torch.rand(D) + 0.5) if qk_norm else (torch.empty(0), torch.empty(0))
    B = K.BLOCK
    table = np.arange(2 * -(-C // B), dtype=np.int32)[::-1].reshape(2, -1).copy()  # blocks in reverse
    kt, v = torch.zeros(Hkv, table.size, D, B), torch.zeros(Hkv, table.size, B, D)
    q = K.qkv_rope_cache(qkv, Hq, Hkv, D, qn.numpy(), kn.numpy(), 1e-6, cos, sin, table, slot, pos, kt, v)

    def rot(x):  # transformers' apply_rotary_pos_emb
        c, s = cos[pos][:, None], sin[pos][:, None]
        return x * c + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * s
    qr, kr, vr = qkv[:, :Hq * D].view(R, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(R, Hkv, D), qkv[:, (Hq + Hkv) * D:]
    if qk_norm:
        qr = K.rmsnorm_ref(qr.reshape(-1, D), qn, 1e-6).view(R, Hq, D)
        kr = K.rmsnorm_ref(kr.reshape(-1, D), kn, 1e-6).view(R, Hkv, D)
    assert torch.equal(q, rot(qr))
    for r in range(R):
        b, o = table[slot[r], pos[r] // B], pos[r] % B
        assert torch.equal(kt[:, b, :, o], rot(kr)[r])
        assert torch.equal(v[:, b, o], vr[r].view(Hkv, D))


def _f32(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def test_fma_ref_rounds_once_where_float64_rounds_twice():
    """1 + 2^-23 + (2^-24 - 2^-70): just below the halfway point between two float32s. float64
    rounds it onto the halfway point and float32's ties-to-even then rounds up; one correctly
    rounded FMA (the kernel, and fma_ref) keeps 1 + 2^-23."""
    a = torch.tensor([2.0 ** -12 * (1 + 2.0 ** -23)])
    b = torch.tensor([2.0 ** -12 * (1 - 2.0 ** -23)])
    c = torch.tensor([1 + 2.0 ** -23])
    naive = (a.double() * b.double() + c.double()).float()
    assert naive.item() == 1 + 2.0 ** -22  # the double-rounding hazard is real
    assert K.fma_ref(a, b, c).item() == 1 + 2.0 ** -23
    # the kernel: chain fma(1, c, 0) = c, then fma(a, b, c)
    x = torch.tensor([[1.0, a.item()]])
    w = torch.tensor([[c.item(), b.item()]])
    assert K.linear(x, K.pack_weight(w)).item() == 1 + 2.0 ** -23


def test_fma_ref_matches_exact_rounding_on_random_values():
    from fractions import Fraction
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(400, generator=g) * 10 ** torch.randint(-3, 4, (400,), generator=g) for _ in range(3))
    got = K.fma_ref(a, b, c)
    for i in range(400):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        lo = np.float32(float(exact))  # a float32 within one ulp; pick the nearest, ties to even
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda f: (abs(Fraction(float(f)) - exact), int(np.array(f).view(np.uint32)) & 1))
        assert got[i].item() == float(best), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fuses_and_a_mul_then_add_twin_would_not_match(dtype):
    """Teeth: the kernel is the FMA chain, not a mul-then-add chain (they differ on random data)."""
    w = _w(96, 200, dtype)
    x = torch.randn(5, 200)
    y = K.linear(x, K.pack_weight(w))
    assert torch.equal(y, K.linear_ref(x, w))
    unfused = torch.zeros(5, 96)
    for k in range(200):
        unfused = unfused + x[:, k:k + 1] * w.float()[:, k]
    assert not torch.equal(y, unfused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tiles_of_every_height_give_the_same_row(dtype):
    """Rows go through register tiles of 1..MR_MAX rows (M = 11 -> 6 + 5 on AVX-512, 3+3+3+2 on
    AVX2); a row's bits never depend on which tile height served it."""
    w = _w(70, 45, dtype)  # 3 blocks, the last one partial
    b = torch.randn(70)
    p = K.pack_weight(w, b)
    x = torch.randn(3 * K.MR_MAX + 2, 45)
    alone = torch.cat([K.linear(x[i:i + 1], p) for i in range(x.shape[0])])
    for M in range(2, x.shape[0] + 1):
        assert torch.equal(K.linear(x[:M], p), alone[:M]), M
    assert torch.equal(alone, K.linear_ref(x, w, b))


def test_serial_builds_have_their_own_disk_cache_entries(tmp_path):
    """numba keys its disk cache by function name, line and signature, not by `parallel`: a serial
    build compiled from the same py_func under the same name loaded the threaded build's machine
    code (or the reverse). Each build must leave its own index file."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np, torch; from exactspec import kernels as K; "
            "p = K.pack_weight(torch.randn(64, 16)); K.linear(torch.randn(1, 16), p); "  # serial
            "q = K.pack_weight(torch.randn(4096, 256)); K.linear(torch.randn(4, 256), q)")  # parallel
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    index = sorted(p.name.split("-")[0] for p in tmp_path.rglob("*.nbi") if p.name.startswith("linear."))
    assert index == ["linear._linear", "linear._linear_serial", "linear.linear_block"], index  # (the block: no prange)


def test_each_weight_type_compiles_one_linear_block(ckpt, monkeypatch):
    """linear_block (the tiles, the costly compile) took its types from each call site: the block index
    uint64 in a parallel loop and int64 in a serial one, each mode constant its own literal type, y a
    column slice ('A') or a whole array ('C'): up to 10 compiles of the same tiles per weight type in
    every forward. All callers go through linear.block, so the parallel and serial builds of the forward
    and of K.linear share one per weight type (and rows type and bias type)."""
    import exactspec
    from exactspec.kernels.linear import linear_block
    from exactspec.model import forward
    m = exactspec.load(ckpt("llama"))
    for limit in (0, 1 << 62):  # the threaded build, then the serial one
        monkeypatch.setattr(forward, "SERIAL_FORWARD", limit)
        m.logits(list(range(3, 12)))
    w = K.pack_weight(torch.randn(4096, 64))
    K.linear(torch.randn(1, 64), w)  # serial
    K.linear(torch.randn(4, 64), w)  # threaded
    sigs = {}
    for s in linear_block.signatures:
        sigs.setdefault(s[:3], []).append(s[3:])
    assert sigs and all(len(v) == 1 for v in sigs.values()), sigs
