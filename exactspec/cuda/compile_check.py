"""Compile every exactspec.cuda kernel, at the configurations its wrappers launch for a Llama-2-7B-shape
model, for NVIDIA GPU architectures: Triton's own compiler and ptxas (shipped in the triton wheel), no GPU
needed. The interpreter tests prove the kernels' logic on the CPU; this proves their GPU code builds.
Run without TRITON_INTERPRET:

    python -m exactspec.cuda.compile_check [--arch 80 90]
"""
from __future__ import annotations

import argparse
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kernels as K

DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096), (192, 64)]  # (N, K) of the weights
HEAD_DIMS = [64, 80, 128]
ROWS = [64, 4096, 32000]


def launches() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, kernel, signature, constexprs, options) of every launch configuration checked."""
    out = []
    for dt, ptr in DTYPES.items():
        for n, k in SHAPES if dt == "bf16" else SHAPES[::3]:  # every shape in bfloat16 (the seed's dtype)
            bm, bn, bk, warps, stages = K.matmul_config(n, k)
            for bias in (False, True) if (n, k) == SHAPES[0] else (False,):
                sig = dict(x=ptr, w=ptr, b="*fp32" if bias else ptr, y=ptr, M="i32", N="i32", K="i32")
                const = dict(HAS_BIAS=bias, BM=bm, BN=bn, BK=bk, UNFUSED=False, IEEE=dt == "fp32")
                out.append((f"matmul {dt} {n}x{k} bias={bias}", K._matmul_kernel, sig, const,
                            dict(num_warps=warps, num_stages=stages)))
        for k in ROWS:
            out.append((f"rmsnorm {dt} {k}", K._rmsnorm_kernel, dict(x=ptr, y=ptr, K="i32", eps="fp32"),
                        dict(BLOCK=K._row_block(k)), dict(num_warps=K.ROW_WARPS)))
            for log in (False, True):
                out.append((f"softmax {dt} {k} log={log}", K._softmax_kernel, dict(x=ptr, y="*fp32", K="i32"),
                            dict(LOG=log, BLOCK=K._row_block(k)), dict(num_warps=K.ROW_WARPS)))
        out.append((f"silu_mul {dt}", K._silu_mul_kernel, dict(gu="*fp32", y=ptr, I="i32"),
                    dict(BLOCK=K.SILU_BLOCK), dict(num_warps=K.ROW_WARPS)))
        for d in HEAD_DIMS:
            for mask_b in (False, True):
                sig = dict(q=ptr, k=ptr, v=ptr, mask="*u8", lohi="*i32", o=ptr, T="i32", S="i32", Hq="i32", HKV="i32",
                           D="i32", scale="fp32")
                out.append((f"attention {dt} head {d} mask_b={mask_b}", K._attention_kernel, sig,
                            dict(MASK_B=mask_b, BN=K.ATTN_BN, BD=triton.next_power_of_2(d)),
                            dict(num_warps=K.ATTN_WARPS)))
    return out


def check(archs: list[int]) -> list[str]:
    """Compile everything for each architecture; return the failures (empty: all built)."""
    if K.INTERPRETED:
        raise RuntimeError("compile_check needs the compiled kernels: run it without TRITON_INTERPRET=1")
    failures = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, sig, const, opts in launches():
            sig = {**sig, **{c: "constexpr" for c in const}}
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target,
                               options={**opts, **K.NO_FUSION})
            except Exception as e:  # noqa: BLE001 - reported by name, with the compiler's message
                failures.append(f"sm_{arch} {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (80: A100, 90: H100)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    failures = check(a.arch)
    n = len(launches()) * len(a.arch)
    print(f"{n - len(failures)}/{n} kernel configurations compiled for sm_{', sm_'.join(map(str, a.arch))} "
          f"in {time.perf_counter() - t0:.0f} s")
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
