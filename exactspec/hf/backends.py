"""Where a patched transformers model's reductions run (exactspec.hf): numba kernels on the CPU
(`NumbaOps`, exactspec.kernels) or Triton kernels on a CUDA device (`TritonOps`, exactspec.cuda).

Both take and return torch tensors in transformers' layouts, with the same contract: a row's result is
a function of that row (and, for attention, of its visible keys) alone. Their bits differ from each
other (other hardware, other orders); each is invariant on its own."""
from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..errors import InvalidRequest, UnsupportedModelError
from .attention import masked_attention


def _np_rows(x: torch.Tensor, name: str) -> np.ndarray:
    if not x.is_cpu:
        raise InvalidRequest(f"{name}: input is on {x.device}; this model is patched with exactspec's CPU kernels")
    r = x.reshape(-1, x.shape[-1])
    return (r.float() if r.dtype != torch.float32 else r.contiguous()).numpy()


def _np_out(y: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(y)
    return t if dtype == torch.float32 else t.to(dtype)


class NumbaOps:
    """exactspec's CPU kernels (numba): float32 arithmetic, float32 MLP intermediates."""
    name = "numba"
    attn_name = "exactspec"  # its attention's name in transformers' AttentionInterface (interface.py)
    dtypes = (torch.float32, torch.bfloat16)

    def __init__(self):
        self._ones: dict[int, np.ndarray] = {}

    def check_device(self, device: torch.device, where: str) -> None:
        if device.type != "cpu":
            raise InvalidRequest(f"exactspec.hf: {where} is on {device}; backend 'numba' runs exactspec's CPU kernels. "
                                 "Move the model to CPU (model.to('cpu')), or patch a CUDA model with backend='triton'")

    def pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> kernels.PackedWeight:
        return kernels.pack_weight(w, bias)

    def linear(self, x: torch.Tensor, packed: kernels.PackedWeight, name: str, dtype: torch.dtype) -> torch.Tensor:
        """(..., K) -> (M, N) in dtype."""
        return _np_out(kernels.linear_np(_np_rows(x, name), packed), dtype)

    def mlp(self, x: torch.Tensor, gate_up: kernels.PackedWeight, down: kernels.PackedWeight, name: str,
            dtype: torch.dtype) -> torch.Tensor:
        h = kernels.silu_mul_np(kernels.linear_np(_np_rows(x, name), gate_up))  # float32 in between
        return _np_out(kernels.linear_np(h, down), dtype)

    def rmsnorm(self, x: torch.Tensor, eps: float, name: str) -> torch.Tensor:
        """(..., K) -> x * rsqrt(mean(x^2) + eps) as (M, K) in x's dtype (the kernel's weight: ones, exact)."""
        rows = _np_rows(x, name)
        ones = self._ones.get(rows.shape[1])
        if ones is None:
            ones = self._ones[rows.shape[1]] = np.ones(rows.shape[1], np.float32)
        return _np_out(kernels.rmsnorm_np(rows, ones, eps), x.dtype)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """q (B, Hq, T, D), k/v (B, Hkv, S, D), mask (B|1, T, S) bool -> (B, T, Hq, D) in q's dtype."""
        arr = _per_mask(mask, _mask_array)
        return masked_attention(q.float(), k.float(), v.float(), arr, scale).to(q.dtype)


_last_mask: tuple = (None, None, None)  # (a mask's base tensor, held; its view and version; what it became)


def _per_mask(mask: torch.Tensor, convert):
    """convert(mask), once per forward: every layer gets a view of the same mask tensor (holding that
    tensor keeps its memory from being another mask's)."""
    global _last_mask
    base = mask._base if mask._base is not None else mask
    view = (mask.storage_offset(), tuple(mask.shape), mask.stride(), mask._version, convert)
    if _last_mask[0] is base and _last_mask[1] == view:
        return _last_mask[2]
    got = convert(mask)
    _last_mask = (base, view, got)
    return got


def _mask_array(mask: torch.Tensor) -> np.ndarray:
    """(B|1, T, S) bool -> uint8 array."""
    return mask.to(torch.uint8).contiguous().numpy()


class TritonOps:
    """exactspec.cuda's Triton kernels: float32 accumulation, results in the model's dtype; the MLP's
    silu(gate) * up rounded to the model's dtype before `down` (as transformers does), so a bfloat16
    model's matmuls all run on tensor cores."""
    name = "triton"
    attn_name = "exactspec_triton"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self):
        try:
            from ..cuda import kernels as ck
        except ImportError as e:
            raise UnsupportedModelError("exactspec.hf: a CUDA model runs on exactspec's Triton kernels, and triton is "
                                        f"not importable ({e}); pip install 'exactspec[cuda]'") from e
        self.k = ck

    def check_device(self, device: torch.device, where: str) -> None:
        if device.type == "cuda" or (device.type == "cpu" and self.k.INTERPRETED):
            return
        if device.type == "cpu":
            raise InvalidRequest(f"exactspec.hf: backend 'triton' on {where} on the CPU runs only under Triton's "
                                 "interpreter (TRITON_INTERPRET=1 before exactspec.cuda is imported); on the CPU use "
                                 "backend='numba'")
        raise InvalidRequest(f"exactspec.hf: {where} is on {device}; exactspec's kernels run on CPU (numba) or CUDA "
                             "(Triton)")

    def pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return w.contiguous(), None if bias is None else bias.float().contiguous()

    def _rows(self, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        if x.device != w.device:
            raise InvalidRequest(f"{name}: input is on {x.device}, its weights on {w.device}")
        return x.reshape(-1, x.shape[-1])

    def linear(self, x, packed, name, dtype):
        w, bias = packed
        return self.k.matmul(self._rows(x, w, name), w, bias, dtype)

    def mlp(self, x, gate_up, down, name, dtype):
        gu = self.k.matmul(self._rows(x, gate_up[0], name), gate_up[0], gate_up[1], torch.float32)
        return self.k.matmul(self.k.silu_mul(gu, dtype), down[0], down[1], dtype)

    def rmsnorm(self, x, eps, name):
        self.check_device(x.device, name)
        return self.k.rmsnorm(x.reshape(-1, x.shape[-1]), eps)

    def attention(self, q, k, v, mask, scale):
        return self.k.attention(q, k, v, mask, scale, _per_mask(mask, self.k.attention_bounds))


_OPS: dict[str, object] = {}


def ops(name: str) -> NumbaOps | TritonOps:
    """The backend called `name` ('numba' or 'triton'), made once."""
    if name not in ("numba", "triton"):
        raise InvalidRequest(f"exactspec.hf: backend {name!r}; known: 'numba' (CPU), 'triton' (CUDA)")
    if name not in _OPS:
        _OPS[name] = NumbaOps() if name == "numba" else TritonOps()
    return _OPS[name]
