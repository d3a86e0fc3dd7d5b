"""What the target CPU has, for speed choices only: the register tile's height. Nothing numerical
depends on it (every tile height computes the same chains)."""
from __future__ import annotations

import llvmlite.binding as llb
from numba.core import config


def _wide_target() -> bool:
    """Does numba compile for a CPU with 32 vector registers (AVX-512)? Only speed depends on it."""
    feats = config.CPU_FEATURES
    if config.CPU_NAME:
        name = config.CPU_NAME
        if not feats:
            return any(s in name for s in ("avx512", "icelake", "sapphire", "cascade", "cooper", "tiger",
                                            "cannonlake", "znver4", "znver5", "graniterapids", "emerald"))
    elif not feats:
        feats = llb.get_host_cpu_features().flatten()
    return "+avx512f" in (feats or "")


# Rows per tile: mr rows x 2 vectors of accumulators, + 2 weight vectors, + broadcasts.
MR_MAX = 10 if _wide_target() else 3
