"""The integer-dot linear kernel alone: a 1536 x 768 weight of each format held in cache (so compute, not
memory, is timed), at 1, 5, 16 and 64 rows: milliseconds, multiply-adds per second, and each row count's time
over one row's (a verify of k drafts pays fwd(k + 1) / fwd(1)). For profiling the tile per instruction set:

    python bench/int_tile.py [--formats q4_1 q8_0 q4_0 q4_k q5_k q6_k] [--threads 2]
    NUMBA_CPU_NAME=haswell python bench/int_tile.py     # AVX2 (vpmaddubsw); alderlake: AVX-VNNI

Q4_K/Q5_K/Q6_K weights are random GGUF blocks with finite scales (the gguf package has no quantizer for them).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import exactspec  # noqa: F401  (sets numba's environment)
from exactspec import kernels as K
from exactspec.kernels import cpu, pack, quant
from exactspec.kernels import linear_np

N, KD = 1536, 768
K_BLOCK = {"q4_k": (144, 0), "q5_k": (176, 0), "q6_k": (210, 208)}  # block bytes, offset of its float16 d


def weight(fmt: str, rng: np.random.Generator) -> pack.PackedWeight:
    if fmt not in K_BLOCK:
        return pack.pack_quant(quant.quantize(rng.standard_normal((N, KD)).astype(np.float32) / 30, fmt), int_dot=True)
    size, at = K_BLOCK[fmt]
    raw = rng.integers(0, 256, (N, KD // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[..., at:at + 2] = scale
    if fmt != "q6_k":
        raw[..., 2:4] = scale  # dmin
    return pack.pack_quant(quant.from_blocks(raw.reshape(N, -1), fmt, N, KD), int_dot=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["q4_1", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    d = cpu.describe()
    print(f"{d['cpu']}, numba target {d['numba_target']}; integer dots: {d['integer_dot']}, "
          f"{d['integer_dot_tile_rows']}-row tiles; {a.threads} threads; weight {N} x {KD}")
    rng = np.random.default_rng(0)
    rows = (1, 5, 16, 64)
    print(f"{'format':>7} " + " ".join(f"{'M=' + str(m) + ' ms':>10}" for m in rows) + f" {'GMAC/s @64':>11} "
          + " ".join(f"{'t(' + str(m) + ')/t(1)':>10}" for m in rows[1:]))
    for fmt in a.formats:
        w = weight(fmt, rng)
        ms = []
        for m in rows:
            x = rng.standard_normal((m, KD)).astype(np.float32)
            linear_np(x, w)  # compile, warm
            reps = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(20):
                    linear_np(x, w)
                reps.append((time.perf_counter() - t) / 20 * 1e3)
            ms.append(statistics.median(reps))
        print(f"{fmt:>7} " + " ".join(f"{t:10.4f}" for t in ms) + f" {64 * N * KD / ms[-1] / 1e6:11.1f} "
              + " ".join(f"{t / ms[0]:10.2f}" for t in ms[1:]), flush=True)


if __name__ == "__main__":
    main()
