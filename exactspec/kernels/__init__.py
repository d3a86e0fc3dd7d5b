"""Batch-invariant CPU kernels (numba), each with a plain torch reference twin.

Contract: every floating-point reduction here runs in an order fixed by the row's own data and
the model's shape, never by the number of rows in the call, the batch, the cache length, the
thread count or the CPU. How that is achieved:

* No `fastmath`: LLVM may not reassociate, and may not contract a multiply and an add into an FMA
  on its own, so the order written in the source *is* the order computed, whatever the compiler
  vectorizes.
* FMA only where the source says so: the linear kernel's register tile (kernels/tile.py) calls
  `llvm.fma` explicitly. An FMA is one correctly rounded IEEE operation, the same bits with or
  without an FMA unit (LLVM falls back to libm's fmaf), so it is as exact as a mul then an add,
  and it halves the vector ops. Allowed because every output is the *same* chain,
  acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K-1 from +0.0, for every row count, tile
  height, thread count and vector width. `linear_ref` computes that chain in plain torch (a
  round-to-odd float64 FMA, `fma_ref`) and matches it bitwise; tests also compile the kernels for
  other CPUs (tests/test_cross_cpu.py) and check a golden record (tests/golden.json).
* Vectorization only across independent outputs (lanes), never along a reduction: a wider or
  narrower vector (SSE, AVX2, AVX-512) splits lanes differently but never changes a lane's chain.
* Threads (numba prange) split outputs: weight blocks, rows, (row, head) pairs. One output is
  always computed by one thread, start to end.
* exp is our own (`expf.exp32`: rint, FMAs and multiplies, each correctly rounded), so an element gets
  the same bits in a vector body or a scalar tail, on any CPU and whatever libm is installed; loops
  that apply it vectorize. (The one libm call left in the kernels: the log of log_softmax's sum, once
  per row; and cos/sin of the RoPE table, in float64, made once.) SVML is disabled in
  `exactspec/__init__.py` before numba is imported.
* FMAs also in attention (scores and the weighted sum of values: one chain per output, the same for
  every query count, kernels/attnvec.py and its scalar twin) and exp32's polynomial; norms, rope and
  softmax use plain mul and add. Attention's sum of exps: 16 partial sums by key (j % 16) and a fixed
  tree (attention._fold), in both paths.

Rooms: `quant` (each format's weight value), `layout` (the packed byte layout), `cpu` (what the
target has: speed only), `tile` (the register tile in LLVM IR), `pack` (weights into that layout),
`linear`, `actquant` (int8 activations; its vector loop: `actvec`), `itile` (the integer-dot tile),
`rows` (norms, SwiGLU and GeGLU, rotary, softmax), `moe` (a mixture of experts' routing), `attention` (its vector loops: `attnvec`), `expf`, `powf` (RoPE's
theta ** (2i / d), SLEEF's float32 pow bit for bit), `threads`
(pool size, serial/parallel builds).
"""
from .attention import BLOCK, as_numpy, attention, attention_ref
from .expf import GEGLU, SWIGLU, fma_ref
from .powf import pow_rope
from .linear import ADD, STORE, linear, linear_np, linear_ref
from .moe import route, route_ref
from .pack import PackedWeight, pack_quant, pack_weight, packed_shape
from .rows import (cumsum, gated_mul, gelu_mul, gelu_mul_ref, log_softmax, qkv_rope_cache, rmsnorm, rmsnorm_np, rmsnorm_ref, rope_table, silu_mul,
                   silu_mul_np, silu_mul_ref, softmax)
from .threads import SERIAL_WORK, TwoBuilds, set_num_threads
from .cpu import MR_MAX
from .layout import NL

__all__ = ["BLOCK", "as_numpy", "attention", "attention_ref", "ADD", "GEGLU", "STORE", "SWIGLU", "fma_ref", "linear", "linear_np", "linear_ref",
           "pow_rope",
           "route", "route_ref", "PackedWeight", "pack_quant", "pack_weight", "packed_shape", "cumsum", "gated_mul", "gelu_mul", "gelu_mul_ref", "log_softmax", "qkv_rope_cache", "rmsnorm",
           "rmsnorm_np", "rmsnorm_ref", "rope_table", "silu_mul", "silu_mul_np", "silu_mul_ref", "softmax",
           "SERIAL_WORK", "TwoBuilds", "set_num_threads", "MR_MAX", "NL"]
