"""A normal (non-editable) install has everything: `pip wheel .` holds every subpackage and the
demo's models (package data), and the package installed from it finds its draft there."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_carries_the_package_and_the_demo_models(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, timeout=600, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("exactspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for room in ("kernels", "model", "text", "decode", "serve", "hf"):
        assert f"exactspec/{room}/__init__.py" in names, room
    for model in ("target", "draft", "smollm2-draft"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"exactspec/assets/{model}/{f}" in names, (model, f)
    for f in ("config.json", "model.safetensors", "head.json", "head.safetensors"):  # SmolLM2's drafting head
        assert f"exactspec/assets/smollm2-head/{f}" in names, f
    # installed from the wheel (dependencies from this environment), away from the source tree:
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, timeout=600)
    code = ("import exactspec; from exactspec.tools.demo import demo_folder; d = demo_folder(); "
            "assert d.is_relative_to(%r), (exactspec.__file__, d); "
            "m = exactspec.load(d / 'smollm2-draft'); print(m.cfg.arch, m.cfg.n_layers)") % str(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "llama"
