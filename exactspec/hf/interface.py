"""The entries exactspec.hf registers with transformers' AttentionInterface: "exactspec" (the CPU
kernels' masked attention) and "exactspec_triton" (exactspec.cuda's), each fed a materialized boolean
mask, so padding and sliding windows reach the kernel key by key."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidRequest
from . import backends

ATTN_NAME = backends.NumbaOps.attn_name  # "exactspec"
ATTN_NAME_TRITON = backends.TritonOps.attn_name  # "exactspec_triton"


def _attention(ops, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None, dropout: float) -> tuple[torch.Tensor, None]:
    if dropout:
        raise InvalidRequest("exactspec attention: dropout > 0 (training mode?); call model.eval()")
    B, Hq, T, D = query.shape
    S = key.shape[2]
    if attention_mask is None:  # no mask was asked for: plain causal, queries are the last T positions
        i = torch.arange(T, device=query.device)[:, None] + (S - T)
        mask = (torch.arange(S, device=query.device)[None, :] <= i)[None]
    elif attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1 or attention_mask.shape[2:] != (T, S):
        raise InvalidRequest(f"exactspec attention: expected a (B, 1, {T}, {S}) boolean mask, got "
                                   f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
    else:
        mask = attention_mask[:, 0]
    scale = scaling if scaling is not None else D ** -0.5
    return ops.attention(query, key, value, mask, scale), None


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The "exactspec" entry of transformers' AttentionInterface (CPU kernels). query (B, Hq, T, D),
    key/value (B, Hkv, S, D), attention_mask (B, 1, T, S) bool from `_mask` -> ((B, T, Hq, D), None)."""
    return _attention(backends.ops("numba"), query, key, value, attention_mask, scaling, dropout)


def attention_forward_triton(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """The "exactspec_triton" entry: the same, through exactspec.cuda's attention kernel."""
    return _attention(backends.ops("triton"), query, key, value, attention_mask, scaling, dropout)


def _mask(**kwargs):
    """transformers' sdpa mask, never skipped: the kernel always sees which keys a row may attend."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(**kwargs)


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        for name, fn in ((ATTN_NAME, attention_forward), (ATTN_NAME_TRITON, attention_forward_triton)):
            AttentionInterface.register(name, fn)
            AttentionMaskInterface.register(name, _mask)
        _registered = True
