"""exactspec: speculative decoding whose output is bitwise the same as plain decoding."""
import os as _os

# Vectorized transcendental libraries (SVML) would give exp/silu a different code path in the
# vector body than in the scalar tail of a loop; keep every element on the scalar libm path.
_os.environ.setdefault("NUMBA_DISABLE_INTEL_SVML", "1")
