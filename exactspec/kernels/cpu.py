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


def _vnni_target() -> bool:
    """Does numba compile for a CPU with AVX512-VNNI (and AVX512BW)? Only speed depends on it: the
    integer-dot tile's sums are exact either way (itile.py)."""
    feats = config.CPU_FEATURES
    if config.CPU_NAME and config.CPU_NAME != "host":
        if not feats:
            return any(s in config.CPU_NAME for s in ("cascadelake", "cooperlake", "icelake", "tigerlake", "rocketlake",
                                                       "sapphirerapids", "graniterapids", "emeraldrapids",
                                                       "diamondrapids", "znver4", "znver5"))
    elif not feats:
        feats = llb.get_host_cpu_features().flatten()
    return "+avx512vnni" in (feats or "") and "+avx512bw" in (feats or "")


# Rows per tile: mr rows x 2 vectors of accumulators, + 2 weight vectors, + broadcasts.
MR_MAX = 10 if _wide_target() else 3
VNNI = _vnni_target()
# Rows per integer-dot tile: mr rows x 2 vectors of float and of integer accumulators.
MR_INT = 6 if _wide_target() else 2
