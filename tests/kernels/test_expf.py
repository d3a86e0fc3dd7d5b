"""exp32 (kernels/expf.py): our exp of a float32, the same bits in a vector body, a scalar tail, its torch
twin and on any CPU (its operations are IEEE ones: rint, fma, mul); under 1 ulp from the true value."""
import numpy as np
import torch
from numba import njit

from exactspec.kernels.expf import exp32, exp32_ref


@njit(cache=False)
def _map(x, y):
    for i in range(x.shape[0]):  # a vectorized body and a scalar tail
        y[i] = exp32(x[i])


def _exp(x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    _map(x, y)
    return y


SPECIAL = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30, -1e-30, 88.72283, 88.72284, -87.33654, -103.0,
                    -104.0, -104.01, -0.34657359, 0.34657359, 1.0, -1.0, 0.5, 10.0, -20.0], np.float32)


def test_exp32_is_within_one_ulp_of_exp_and_handles_the_edges():
    rng = np.random.default_rng(0)
    x = np.concatenate([SPECIAL, rng.uniform(-105, 89, 1_000_000).astype(np.float32),
                        rng.uniform(-1, 1, 200_000).astype(np.float32)])
    y = _exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    finite = np.isfinite(want) & (want < np.finfo(np.float32).max)
    ulp = np.maximum(np.spacing(want[finite].astype(np.float32)).astype(np.float64), 2.0 ** -149)
    assert np.max(np.abs(y[finite] - want[finite]) / ulp) < 1.0  # subnormal results too
    assert np.isnan(y[2]) and y[3] == np.inf and y[4] == 0.0 and y[0] == 1.0 and y[1] == 1.0
    assert y[8] == np.inf and y[7] < np.inf and y[10] > 0.0 and y[12] == 0.0
    assert np.all(y[x > 88.72284] == np.inf) and np.all(y[x < -104.0] == 0.0)


def test_exp32_same_bits_in_a_vector_body_a_scalar_tail_and_the_torch_twin():
    rng = np.random.default_rng(1)
    x = np.concatenate([SPECIAL, rng.uniform(-110, 95, 100_003).astype(np.float32)])
    y = _exp(x)
    alone = np.array([_exp(x[i:i + 1])[0] for i in range(0, 4000, 7)])  # each element as a scalar tail
    assert np.array_equal(y[0:4000:7], alone, equal_nan=True)
    shifted = _exp(x[3:])  # every element in another lane
    assert np.array_equal(y[3:], shifted, equal_nan=True)
    ref = exp32_ref(torch.from_numpy(x)).numpy()
    assert np.array_equal(y.view(np.uint32)[~np.isnan(y)], ref.view(np.uint32)[~np.isnan(y)])
    assert np.isnan(ref[np.isnan(y)]).all()


def test_gelu_mul_equals_its_torch_twin_bitwise_and_is_close_to_torchs_gelu():
    """GeGLU (Gemma 3's MLP): the kernel (gelu32 on exp32) == its torch twin bit for bit on random values,
    ties of sign, zeros, huge and tiny magnitudes, inf and NaN, at every row count (vector body and tail);
    within float32 noise of torch's gelu(approximate="tanh") times up."""
    from exactspec.kernels import gelu_mul, gelu_mul_ref
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(600, generator=g) * 4, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 1e30,
                                                                      -1e30, float("inf"), -float("inf"), 88.0, -88.0])])
    up = torch.randn(gate.shape[0], generator=g)
    for rows in (1, 3, 7):
        gu = torch.cat([gate, up]).repeat(rows, 1)
        got, want = gelu_mul(gu), gelu_mul_ref(gu)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    finite = gate.abs() < 1e4
    ref = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    assert ((got[0] - ref).abs()[finite] <= 1e-6 * (1 + ref.abs()[finite])).all()
    nan = torch.cat([torch.tensor([float("nan")]), torch.ones(1)])[None]
    assert gelu_mul(nan).isnan().all()
