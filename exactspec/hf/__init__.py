"""transformers, made exact: `patch(model)` / `batch_invariant()` route a transformers model's
reductions to exactspec's kernels (patching.py; the kernels a backend's, backends.py: numba on the CPU,
exactspec.cuda's Triton on a GPU; attention entries in interface.py, the CPU one in attention.py); `diff`
compares two ways of decoding and reports the first divergence (diff.py)."""
from .interface import ATTN_NAME, ATTN_NAME_TRITON, attention_forward
from .patching import (SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, Handle, batch_invariant,
                    check_transformers_version, is_patched, patch, transformers_version)

__all__ = ["ATTN_NAME", "ATTN_NAME_TRITON", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "Handle", "attention_forward",
           "batch_invariant", "check_transformers_version", "is_patched", "patch", "transformers_version"]
