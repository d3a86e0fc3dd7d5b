"""What the target CPU has, for speed choices only: the register tile's height. Nothing numerical
depends on it (every tile height computes the same chains)."""
from __future__ import annotations

import llvmlite.binding as llb
from numba.core import config


def _target_has(features: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Does numba compile for a CPU with all of `features` (LLVM names, e.g. "+avx512f")? Told by
    NUMBA_CPU_FEATURES, else by a NUMBA_CPU_NAME containing one of `names`, else (no name, or "host")
    by the host's features. Only speed depends on the answers."""
    feats = config.CPU_FEATURES
    if config.CPU_NAME and config.CPU_NAME != "host" and not feats:
        return any(n in config.CPU_NAME for n in names)
    feats = feats or llb.get_host_cpu_features().flatten()
    return all(f in feats for f in features)


# 32 vector registers (AVX-512).
_WIDE = _target_has(("+avx512f",), ("avx512", "icelake", "sapphire", "cascade", "cooper", "tiger", "cannonlake",
                                    "znver4", "znver5", "graniterapids", "emerald"))
# Rows per tile: mr rows x 2 vectors of accumulators, + 2 weight vectors, + broadcasts.
MR_MAX = 10 if _WIDE else 3
# AVX512-VNNI: the integer-dot tile's `vpdpbusd` (its sums are exact either way, itile.py).
VNNI = _target_has(("+avx512vnni", "+avx512bw"), ("cascadelake", "cooperlake", "icelake", "tigerlake", "rocketlake",
                                                  "sapphirerapids", "graniterapids", "emeraldrapids", "diamondrapids",
                                                  "znver4", "znver5"))
# AVX-VNNI: the 256-bit VEX `vpdpbusd` of Intel client CPUs since Alder Lake (AVX-512 fused off there).
AVXVNNI = not VNNI and _target_has(("+avxvnni",), ("alderlake", "raptorlake", "meteorlake", "arrowlake", "lunarlake",
                                                   "pantherlake", "sierraforest", "grandridge", "clearwaterforest"))
# AVX2: the integer-dot tile's `vpmaddubsw` + `vpmaddwd` (pairs of products summed in int16 without saturating for
# these quants, then in int32: the same exact sums, itile.py).
AVX2 = _target_has(("+avx2",), ("haswell", "broadwell", "skylake", "cascade", "cooper", "cannon", "icelake", "tiger",
                                "rocket", "alder", "raptor", "meteor", "arrow", "lunar", "panther", "sapphire", "granite",
                                "emerald", "diamond", "sierra", "grandridge", "clearwater", "znver", "x86-64-v3",
                                "x86-64-v4"))
# The integer-dot tile's AVX2 path (vpmaddubsw): AVX2 without either VNNI.
MADDUBS = AVX2 and not (VNNI or AVXVNNI)
# F16C: float16 scales widened by `vcvtph2ps` (exact: every float16 is a float32), else in integer ops.
F16C = _target_has(("+f16c",), ("ivybridge", "haswell", "broadwell", "skylake", "cascade", "cooper", "cannon", "icelake",
                                "tiger", "rocket", "alder", "raptor", "meteor", "sapphire", "granite", "emerald",
                                "diamond", "znver", "bdver2", "bdver3", "bdver4", "x86-64-v3", "x86-64-v4"))
# Rows per integer-dot tile: mr rows x 2 vectors of float and of integer accumulators. (8-bit weights on AVX2 took
# 1-row tiles for a while, chosen from a "haswell" build that was AVX-512 code; with AVX2 code, a 1536 x 768 Q8_0
# weight at 5 / 64 rows takes 0.087-0.099 / 0.94-1.07 ms in 2-row tiles, 0.119-0.160 / 1.31-1.86 in 1-row ones.)
MR_INT = 6 if _WIDE else 2
# AVX2 and AVX-VNNI (16 ymm registers): integer-dot tiles of 2 or more rows as half tiles (one output vector of a
# block, up to MR_HALF rows): a quad's unpacking (2-3x a 4-bit one's for 5- and 6-bit quants, Q8_0's |w|) shared by
# twice the rows in the same registers (tile.py). A 1536 x 768 weight at 64 rows, AVX2: Q5_0 0.84 -> 0.62 ms, Q6_K
# 1.2 -> 0.9, Q8_0 0.89 -> 0.69, 4-bit about the same; AVX-VNNI: Q5_0 0.79 -> 0.58, Q4_K 0.55 -> 0.49, the rest about
# the same. One row keeps the whole tile (a 4-bit row measured 0.015 -> 0.019 ms in two halves).
HALF_TILES = MADDUBS or AVXVNNI
MR_HALF = 4


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def describe() -> dict:
    """What a bug report needs of the kernels' build: the CPU, the numba target compiled for, and the
    path each kernel family takes on it (speed only: every path gives the same bits)."""
    host = set(llb.get_host_cpu_features().flatten().split(","))
    int_dot = ("AVX512-VNNI vpdpbusd (512-bit)" if VNNI else "AVX-VNNI vpdpbusd (256-bit)" if AVXVNNI else
               "AVX2 vpmaddubsw + vpmaddwd" if AVX2 else "widening multiplies (no AVX2)")
    return {"cpu": _cpu_model(), "host_cpu_name": llb.get_host_cpu_name(),
            "host_features": sorted(f[1:] for f in host if f[1:] in (
                "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avxvnni", "avx512bf16", "amx-int8")
                and f.startswith("+")),
            "numba_target": config.CPU_NAME or "host", "numba_features": config.CPU_FEATURES or None,
            "integer_dot": int_dot, "float_tile": f"{'32' if _WIDE else '16'} vector registers, {MR_MAX}-row tiles",
            "integer_dot_tile_rows": MR_INT,
            "float16_scales": "F16C vcvtph2ps" if F16C else "integer ops"}
