"""transformers, made exact: `patch(model)` / `batch_invariant()` route a transformers model's
reductions to exactspec's kernels (patching.py, with the masked attention in attention.py); `diff`
compares two ways of decoding and reports the first divergence (diff.py)."""
from .patching import (ATTN_NAME, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, Handle, attention_forward, batch_invariant,
                    check_transformers_version, is_patched, patch, transformers_version)

__all__ = ["ATTN_NAME", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "Handle", "attention_forward",
           "batch_invariant", "check_transformers_version", "is_patched", "patch", "transformers_version"]
