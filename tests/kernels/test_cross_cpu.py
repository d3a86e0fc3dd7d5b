"""Same bits on any x86-64 CPU: the kernels compiled for other targets (NUMBA_CPU_NAME, each in a
subprocess with its own numba cache) give exactly the record this process gives, and the record
committed in golden.json (made on another machine, so CI on an AMD or Intel machine proves it for
real). Targets: generic x86-64 (SSE2 only: no FMA unit, llvm.fma becomes libm's fmaf; no F16C, float16
scales widened in integer ops), haswell (AVX2 + FMA + F16C, 16 vector registers, 3-row tiles) and, where
this CPU can run it, skylake-avx512 (AVX-512, 32 registers, 10-row tiles, no VNNI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llb
import pytest

from tests.kernels import golden

pytestmark = pytest.mark.slow  # compiles the kernels for 3 CPU targets (minutes)

HERE = Path(__file__).parent
_HOST = llb.get_host_cpu_features().flatten()
TARGETS = ["generic", "haswell"] + (["skylake-avx512"] if "+avx512f" in _HOST else []) + (
    ["alderlake"] if "+avxvnni" in _HOST else [])  # AVX-VNNI: run where the host has it, else compiled below




def test_this_machine_reproduces_the_golden_record(here_record):
    want = json.loads(golden.GOLDEN.read_text())
    assert here_record == want, "this CPU computes other bits than the machine that wrote golden.json"
    assert all(v for k, v in want.items() if k.startswith("lookup_equals"))


@pytest.fixture(scope="module")
def other_targets(tmp_path_factory):
    """golden.py compiled for every target, all started at once: compiling is single-threaded, so the
    machine's cores compile several targets side by side (minutes of CI saved)."""
    procs = {}
    for t in TARGETS:
        env = dict(os.environ, NUMBA_CPU_NAME=t, NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp(t) / "numba"))
        procs[t] = subprocess.Popen([sys.executable, str(HERE / "golden.py"), "--kernels"], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        p.kill()
        p.communicate()


@pytest.fixture(scope="module")
def here_record(other_targets):
    return golden.record()  # while the other targets compile


@pytest.mark.parametrize("target", TARGETS)
def test_other_compile_targets_give_the_same_bits(here_record, other_targets, target):
    out, err = other_targets[target].communicate(timeout=1800)
    assert other_targets[target].returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    # every kernel and the float32 models (Llama, Gemma 3, Qwen3-MoE); the bfloat16 and int8-activation models'
    # kernels are among the kernels, their forwards compiled here only (a forward compile is minutes per target)
    assert set(here_record) - set(got) == {f"{k}_{m}" for k in ("logits", "greedy", "lookup_equals_greedy")
                                           for m in ("bfloat16", "q8_0i")} | {"sampled_bfloat16"}, target
    assert got == {k: here_record[k] for k in got}, target


def test_the_tile_height_follows_the_target():
    """Teeth for the test above: the targets really compile different tile shapes and instructions."""
    code = "from exactspec.kernels import cpu; print(cpu.MR_MAX, cpu.MR_INT, cpu.VNNI, cpu.AVXVNNI, cpu.AVX2)"
    heights = {}
    for target in ("generic", "haswell", "alderlake", "skylake-avx512", "icelake-server"):
        env = dict(os.environ, NUMBA_CPU_NAME=target)
        heights[target] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                         check=True).stdout.strip()
    # icelake-server (VNNI) is only named, never run here: the golden record covers it where the host has VNNI
    assert heights == {"generic": "3 2 False False False", "haswell": "3 2 False False True",
                       "alderlake": "3 2 False True True", "skylake-avx512": "10 6 False False True",
                       "icelake-server": "10 6 True False True"}


_INT_DOT_ASM = """
import re, sys, numpy as np, numba
from numba import types
from exactspec import kernels as K
from exactspec.kernels import quant
L = sys.modules["exactspec.kernels.linear"]
out, spills = {}, {}


def spilled(asm):  # vector registers stored to or loaded from the stack
    return sum(1 for ln in asm.splitlines() if ln.split()[:1] and ln.split()[0].startswith("vmov") and "(%rsp)" in ln
               and "mm" in ln)


for fmt in ("q4_0", "q8_0", "q6_k"):
    n, k = (32, 256)
    if fmt == "q6_k":
        from exactspec.tools.testing import K_QUANT_BLOCKS
        w = quant.from_blocks(K_QUANT_BLOCKS[fmt](n, k, seed=0), fmt, n, k)
    else:
        w = quant.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), fmt)
    p = K.pack_quant(w, int_dot=True)
    acts = types.Tuple([types.Array(t, 2, "A") for t in (types.int8, types.float32, types.int32)])  # (q, d, s)
    sig = (acts, numba.typeof(p.data), types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "A"),
           types.int64, types.int64)
    L.linear_block.compile(sig)  # compiled, never run (nothing compiled for the target runs: the host may lack it)
    asm = L.linear_block.inspect_asm(sig)
    spills[fmt] = spilled(asm)
    out[fmt] = sorted({" ".join(m.split()) for m in re.findall(r"\\b(vpdpbusd\\s+%[yz]mm(?=\\d)|vpmaddubsw\\b|vpmaddwd\\b|vpsignb\\b|vpmullw\\b)",
                                                         asm)} | ({"zmm"} if "%zmm" in asm else set()))
import torch  # the float tile: float32 and bfloat16 weights, float rows
for dt in ("float32", "bfloat16"):
    p = K.pack_weight(torch.randn(32, 256).to(getattr(torch, dt)))
    sig = (types.Array(types.float32, 2, "A"), numba.typeof(p.data), types.Array(types.float32, 1, "C"),
           types.Array(types.float32, 2, "A"), types.int64, types.int64)
    L.linear_block.compile(sig)
    asm = L.linear_block.inspect_asm(sig)
    spills[dt] = spilled(asm)
    out[dt] = sorted({"vfmadd231ps %" + m for m in re.findall(r"vfmadd231ps\\s+[^\\n]*%([xyz]mm)\\d+\\s*$", asm, re.M)}
                     | ({"zmm"} if "%zmm" in asm else set()))
print(out)
print(spills)
"""


_F16 = {"float32": ["vfmadd231ps %ymm"], "bfloat16": ["vfmadd231ps %ymm"]}  # 16 ymm registers: no zmm anywhere
_F32 = {"float32": ["vfmadd231ps %zmm", "zmm"], "bfloat16": ["vfmadd231ps %zmm", "zmm"]}


# The most vector spills and fills allowed in linear_block, where measured: the AVX2 integer tile without its
# pinned schedule (itile.ITile.pin) spilled every weight vector (q4_0 567, q8_0 575; pinned 54, 186), and the
# float tiles taller than MR_MAX, never called, were compiled anyway (1576; as traps 21); Q6_K kept both halves'
# integer sums and every widened sum in registers (728; combined by half, widened sums in t, half tiles: 161).
_SPILLS = {"q4_0": 150, "q8_0": 300, "q6_k": 250, "float32": 100, "bfloat16": 100}


@pytest.mark.parametrize("target,want,most_spills", [
    ("haswell", {"q4_0": ["vpmaddubsw", "vpmaddwd"], "q8_0": ["vpmaddubsw", "vpmaddwd", "vpsignb"],
                 "q6_k": ["vpmaddubsw", "vpmaddwd"], **_F16}, _SPILLS),
    ("alderlake", {**{f: ["vpdpbusd %ymm"] for f in ("q4_0", "q8_0", "q6_k")}, **_F16}, {}),
    ("icelake-server", {**{f: ["vpdpbusd %zmm", "zmm"] for f in ("q4_0", "q8_0", "q6_k")}, **_F32}, {})])
def test_each_target_compiles_its_integer_dot_instruction(tmp_path, target, want, most_spills):
    """The integer-dot tile's instruction per instruction set, read in the generated assembly: AVX2
    `vpmaddubsw` + `vpmaddwd` (8-bit weights with `vpsignb`), AVX-VNNI's 256-bit `vpdpbusd`, AVX512-VNNI's
    512-bit one; no widening multiplies (`vpmullw`). The float tile (float32, bfloat16 weights): FMAs on ymm
    for the AVX2 targets, zmm for AVX-512. No zmm register at all in an AVX2 target's code: NUMBA_CPU_NAME
    alone kept the host's features (exactspec/__init__.py), and an AVX-512 host built "haswell" with
    AVX-512. The AVX2 build's vector spills are bounded (_SPILLS). (Its bits: the golden record, where it runs.)"""
    env = dict(os.environ, NUMBA_CPU_NAME=target, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    r = subprocess.run([sys.executable, "-c", _INT_DOT_ASM], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    *_, got, spills = r.stdout.strip().splitlines()
    assert eval(got) == want
    spills = eval(spills)
    assert all(spills[f] <= n for f, n in most_spills.items()), spills
