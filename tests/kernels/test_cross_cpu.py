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
TARGETS = ["generic", "haswell"] + (["skylake-avx512"] if "+avx512f" in llb.get_host_cpu_features().flatten() else [])




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
    """Teeth for the test above: the targets really compile different tile shapes."""
    code = "from exactspec.kernels import cpu; print(cpu.MR_MAX, cpu.MR_INT, cpu.VNNI)"
    heights = {}
    for target in ("haswell", "skylake-avx512", "icelake-server"):
        env = dict(os.environ, NUMBA_CPU_NAME=target)
        heights[target] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                         check=True).stdout.strip()
    # icelake-server (VNNI) is only named, never run here: the golden record covers it where the host has VNNI
    assert heights == {"haswell": "3 2 False", "skylake-avx512": "10 6 False", "icelake-server": "10 6 True"}
