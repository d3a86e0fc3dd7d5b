"""Integer-dot kernels (int8 activations, kernels/actquant.py and itile.py): the activation quantizer
equals its torch twin bitwise (ties, zeros, extremes, non-finite blocks); each format's kernel equals
its integer reference twin (int64 sums, the float combine by fma_ref) for every tile height and
thread count; the layouts hold the same weights as the float layouts; the embedding lookup reads them."""
import numpy as np
import pytest
import torch

from exactspec import kernels as K
from exactspec.kernels import cpu, layout, quant
from exactspec.kernels.actquant import linear_int_ref, quantize_rows, quantize_rows_ref
from exactspec.tools.testing import K_QUANT_BLOCKS as KQ  # super-blocks of 256

FORMATS = quant.FORMATS


def _weights(fmt: str, n: int, k: int, seed: int) -> quant.Quantized:
    rng = np.random.default_rng(seed)
    if fmt in KQ:  # no quantizer in the gguf package: random valid blocks
        return quant.from_blocks(KQ[fmt](n, k, seed=seed), fmt, n, k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[: n // 3] += 3.0  # Q4_1 blocks with a large minimum
    return quant.quantize(w, fmt)


def _hard_rows(M: int, K: int, seed: int) -> torch.Tensor:
    """Rows with many exponents, plus blocks of exact ties, zeros, +-amax and denormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)
    x[0, :32] = torch.arange(32, dtype=torch.float32) - 15.5
    x[0, 0] = 127.0  # d = 127 / 127 = 1: every other value of the block is an exact tie k + 1/2
    if K >= 64:
        x[1, 32:64] = 0.0  # a zero block: d = 0, q = 0
        x[2, 32:64] = torch.where(torch.arange(32) % 2 == 0, 3.0, -3.0)  # all +-amax
    if K >= 96:
        x[3, 64:96] = torch.randn(32, generator=g) * 1e-40  # denormal values (and a denormal scale)
    return x


def test_activation_quantizer_equals_its_twin_on_ties_zeros_and_extremes():
    x = _hard_rows(7, 128, 0)
    q, d, s = quantize_rows(x.numpy())
    rq, rd, rs = quantize_rows_ref(x)
    assert np.array_equal(q, rq.numpy()) and np.array_equal(d.view(np.uint32), rd.numpy().view(np.uint32))
    assert np.array_equal(s, rs.numpy())
    assert d[0, 0] == 1.0 and list(q[0, 1:6]) == [-14, -14, -12, -12, -10]  # -14.5 -> -14, -13.5 -> -14: half to even
    assert d[1, 1] == 0 and not q[1, 32:64].any()
    assert set(q[2, 32:64]) == {127, -127}
    assert np.abs(q).max() <= 127  # never -128: no saturation in any instruction's pair sums
    assert 0 < d[3, 2] < np.finfo(np.float32).tiny and np.abs(q[3, 64:96]).max() == 127


def test_vector_quantizer_gives_the_bits_of_the_scalar_loops():
    """The kernels quantize by vector code (kernels/actvec.py): the same q, d and s bits as the scalar loops
    (actquant._quantize_row) on ties, zeros, extremes, denormals, NaN and infinite blocks, huge values."""
    g = torch.Generator().manual_seed(4)
    x = _hard_rows(9, 256, 4)
    x[4, :32] = float("nan")
    x[4, 40] = float("inf")
    x[5, 64] = -float("inf")
    x[5, 96:128] = 3.4e38 * torch.sign(torch.randn(32, generator=g))  # near the largest float: x / d still finite
    x[6, :] = torch.randint(-127, 128, (256,), generator=g).float() / 127.0  # quotients on integers and halves
    x[7, :] = -0.0
    x[8, :] = torch.randn(256, generator=g) * 1e-45  # the smallest denormals: d underflows to 0
    for rows in (x, x[3:4], torch.randn(33, 576, generator=g)):
        v, sc = quantize_rows(rows.numpy()), quantize_rows(rows.numpy(), scalar=True)
        assert np.array_equal(v[0], sc[0]) and np.array_equal(v[2], sc[2])
        assert np.array_equal(v[1].view(np.uint32), sc[1].view(np.uint32))


def test_a_block_that_is_not_finite_gives_nan_outputs_not_garbage():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    q, d, s = quantize_rows(x.numpy())
    rq, rd, rs = quantize_rows_ref(x)
    assert np.array_equal(q, rq.numpy()) and np.array_equal(np.isnan(d), np.isnan(rd.numpy()))
    assert np.isnan(d[0, 0]) and np.isnan(d[1, 1]) and not np.isnan(d[2]).any() and not q[0, :32].any()
    p = K.pack_quant(_weights("q8_0", 40, 64, 1), int_dot=True)
    y = K.linear(x, p)
    assert y[:2].isnan().all() and not y[2].isnan().any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_dot_layout_holds_the_same_weights(fmt):
    k = 512 if fmt in KQ else 96
    w = _weights(fmt, 70, k, 2)
    f, i = K.pack_quant(w), K.pack_quant(w, int_dot=True)
    assert i.fmt == fmt + "i" and i.int_dot and not f.int_dot
    assert i.data.nbytes == f.data.nbytes  # the same bytes, in another order
    assert np.array_equal(i.unpack().numpy().view(np.uint32), f.unpack().numpy().view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,bias", [(77, 64, False), (100, 96, True), (32, 32, False)])
def test_integer_dot_kernel_equals_its_integer_twin(fmt, n, k, bias):
    k = k * 8 if fmt in KQ else k  # whole super-blocks of 256
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)) if bias else None
    p = K.pack_quant(_weights(fmt, n, k, n), b, int_dot=True)
    M = 3 * cpu.MR_MAX + 2
    x = _hard_rows(M, k, n)
    whole = K.linear(x, p)
    assert torch.equal(whole, linear_int_ref(x, p))
    for m in range(1, M + 1):  # every tile height: a row's bits never depend on the rows beside it
        assert torch.equal(K.linear(x[:m], p), whole[:m])
    assert torch.equal(K.linear(x[5:9], p), whole[5:9])
    K.set_num_threads(1)
    try:
        assert torch.equal(K.linear(x, p), whole)
    finally:
        K.set_num_threads(2)
    # close to the float path: the int8 rounding of the activations, nothing else
    ref = K.linear(x, K.pack_quant(_weights(fmt, n, k, n), b))
    rel = (whole - ref).norm() / ref.norm()
    assert rel < 0.02, rel


def test_extreme_blocks_do_not_saturate():
    """Weights at the ends of their range (Q8_0 -128 and 127: 255 and 0 stored) against activations at
    +-127: the largest products any instruction sees (a pmaddubsw would saturate at 2 * 255 * 127)."""
    n, k = 32, 64
    q = np.where(np.arange(n * k).reshape(n, k) % 3 == 0, -128, 127).astype(np.int8)
    w = quant.Quantized("q8_0", q, np.full((n, k // 32), 1.0, np.float16))
    p = K.pack_quant(w, int_dot=True)
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(3, 1)
    x[1] = 1.0
    x[2] = -1.0
    y = K.linear(x, p)
    assert torch.equal(y, linear_int_ref(x, p))
    exact = torch.from_numpy(q.astype(np.float64)) @ x.double().T
    assert torch.allclose(y.double(), exact.T, rtol=1e-6, atol=1e-5)  # (d = 1/127 rounds)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_are_looked_up_from_integer_dot_blocks(fmt):
    from exactspec.model import forward as F
    p = K.pack_quant(_weights(fmt, 77, 256, 5), int_dot=True)
    tokens = np.array([0, 76, 31, 32, 15, 16, 5, 5], np.int64)
    got = F.embed_rows(p.data, tokens, 256)
    assert np.array_equal(got.view(np.uint32), p.unpack().numpy()[tokens].view(np.uint32))


def test_layouts_are_named_apart():
    assert {f for f, F in layout.LAYOUTS.items() if F.int_dot} == {f + "i" for f in FORMATS}
    assert all(layout.LAYOUTS[f + "i"].record_bytes == layout.LAYOUTS[f].record_bytes for f in FORMATS)
