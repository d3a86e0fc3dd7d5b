"""RoPE's inverse frequencies without torch: the same bits as the torch code that made them until now (its twin
here), for every architecture's tiny test model, the real models' settings, scaled RoPE (llama3, linear, a GGUF
file's freq_factors) and a sweep of theta; and theta ** (2i / d) is SLEEF's float32 pow bit for bit where torch's
pow ran SLEEF, which is not always the correctly rounded float32 (so neither a float64 pow nor libm's would do)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from exactspec.kernels import pow_rope
from exactspec.model.config import load_config
from exactspec.model.transformer import inv_freq

from tests.helpers import ARCHS


def llama3_factors_torch(f: torch.Tensor, s: dict) -> torch.Tensor:
    ctx, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    wl = 2 * math.pi / f
    smooth = (ctx / wl - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wl < ctx / high, torch.ones_like(f), torch.where(wl > ctx / low, torch.full_like(f, factor),
                                                                         blended))


def inv_freq_torch(cfg, local: bool = False) -> torch.Tensor:
    """The torch code inv_freq replaced, as it was."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    f = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None or local:
        return f
    if "linear" in s:
        return f / s["linear"]
    factors = torch.tensor(s["freq_factors"], dtype=torch.float32) if "freq_factors" in s else llama3_factors_torch(f, s)
    return f / factors


def same(cfg, local: bool = False) -> bool:
    got = inv_freq(cfg, local)
    want = inv_freq_torch(cfg, local).numpy()
    return got.dtype == np.float32 and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_test_models_keep_their_bits(ckpt, arch):
    cfg = load_config(ckpt(arch))
    assert same(cfg) and (cfg.rope_local_theta is None or same(cfg, local=True))


LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def rope(d, theta, scaling=None, local=None):
    return SimpleNamespace(head_dim=d, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local)


def test_real_models_and_scaled_ropes_keep_their_bits():
    cfgs = [rope(64, 100000.0), rope(64, 10000.0), rope(128, 1000000.0), rope(64, 500000.0, LLAMA3),
            rope(128, 500000.0, dict(LLAMA3, factor=8.0)), rope(256, 1000000.0, {"linear": 8.0}, local=10000.0),
            rope(128, 1000000.0), rope(64, 1000000.0), rope(128, 10000.0)]
    rng = np.random.default_rng(0)
    cfgs.append(rope(64, 500000.0, {"freq_factors": rng.uniform(1, 32, 32).astype(np.float32).tolist()}))
    for c in cfgs:
        assert same(c), c
        assert c.rope_local_theta is None or same(c, local=True)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_sweep_of_theta_keeps_its_bits(d):
    """Where torch ran its vector body on every element (d / 2 a multiple of 32: AVX2 and AVX-512 alike)."""
    rng = np.random.default_rng(d)
    for theta in [1e4, 1e5, 5e5, 1e6, 1e7] + rng.uniform(2.0, 2e7, 60).tolist():
        assert same(rope(d, theta)), theta


def test_pow_is_sleefs_not_the_correctly_rounded_one():
    """torch's float32 pow (SLEEF powf_u10) against pow_rope on random bases and exponents: equal bits, where
    SLEEF differs from the correctly rounded result in ~2% of them."""
    rng = np.random.default_rng(1)
    x = rng.uniform(1.01, 1e7, 500).astype(np.float32)
    y = rng.uniform(0, 1, (500, 32)).astype(np.float32)
    want = (torch.from_numpy(x)[:, None] ** torch.from_numpy(y)).numpy()
    got = np.stack([pow_rope(float(b), e) for b, e in zip(x, y)])
    rounded = (x.astype(np.float64)[:, None] ** y.astype(np.float64)).astype(np.float32)
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch without a vector capability computes pow with libm here")
    assert got.tobytes() == want.tobytes()
    assert (got != rounded).sum() > 100
    assert pow_rope(3.0, np.zeros(2, np.float32)).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="theta"):
        pow_rope(0.0, y[0])
