"""`exactspec generate` end to end, as a user runs it."""
import json

import pytest

import exactspec
from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # `exactspec` in subprocesses, each compiling


def test_generate_json_equals_api(ckpt):
    d = str(ckpt("qwen2"))
    r = run_cli("generate", "--model", d, "--prompt", "def fibonacci(n):", "--max-new-tokens", "25", "--ignore-eos",
             "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    api = exactspec.load(d).generate("def fibonacci(n):", max_new_tokens=25, ignore_eos=True)
    assert out["token_ids"] == api.token_ids and out["text"] == api.text
    assert out["stats"]["new_tokens"] == 25 and out["stats"]["forward_passes"] == 25


def test_generate_streams_text_and_prints_draft_stats(ckpt):
    d = str(ckpt("llama"))
    plain = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "40", "--ignore-eos")
    spec = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "40", "--ignore-eos",
                "--draft", d, "--num-draft-tokens", "dynamic", "--threads", "1")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert plain.stdout == spec.stdout  # the same text, streamed
    assert "40 tokens" in spec.stderr and "accepted (100.0%)" in spec.stderr
    look = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "40", "--ignore-eos",
                "--draft", "lookup", "--num-draft-tokens", "3", "--dtype", "bfloat16")
    assert look.returncode == 0 and "proposed" in look.stderr


def test_generate_constrained_and_its_errors(ckpt, tmp_path):
    d = str(ckpt("llama"))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]}))
    r = run_cli("generate", "--model", d, "--prompt", "import os", "--json-schema", f"@{schema}", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(json.loads(r.stdout)["text"]) in ({"a": "x"}, {"a": "yy"})
    r = run_cli("generate", "--model", d, "--prompt", "import os", "--choice", "fox", "dog", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["text"] in ("fox", "dog"), r.stderr
    r = run_cli("generate", "--model", d, "--prompt", "import os", "--regex", "(unclosed")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "regex" in r.stderr, r.stderr
    r = run_cli("generate", "--model", d, "--prompt", "x", "--json-schema", f"@{tmp_path / 'missing.json'}")
    assert r.returncode == 2 and "cannot read the file" in r.stderr, r.stderr


def test_serve_errors_are_one_line_exit_2(tmp_path):
    r = run_cli("serve", "--model", str(tmp_path / "missing"), "--port", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing: no such file or directory" in r.stderr
    r = run_cli("serve", "--model", str(tmp_path), "--max-batch", "0")
    assert r.returncode == 2 and "--max-batch 0" in r.stderr


def test_distill_head_then_generate_with_it(ckpt, tmp_path):
    d = str(ckpt("llama"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\ndef main():\nclass A:\n")
    out = tmp_path / "head"
    r = run_cli("distill", "--head", "--target", d, "--out", str(out), "--prompts", str(prompts),
                "--record-minutes", "0.2", "--minutes", "0.05", "--draft-vocab", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["draft_vocab"] == 64 and (out / "head.json").is_file()
    plain = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "30", "--ignore-eos")
    spec = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "30", "--ignore-eos",
                   "--draft", f"head:{out}+lookup")
    assert spec.returncode == 0 and spec.stdout == plain.stdout, spec.stderr
    tree = run_cli("generate", "--model", d, "--prompt", "import os", "--max-new-tokens", "30", "--ignore-eos",
                   "--draft", f"head:{out}", "--draft-branches", "3")
    assert tree.returncode == 0 and tree.stdout == plain.stdout, tree.stderr
    bad = run_cli("generate", "--model", d, "--prompt", "x", "--draft", "lookup", "--draft-branches", "0")
    assert bad.returncode == 2 and "draft_branches" in bad.stderr
    (tmp_path / "empty.txt").write_text("\n")
    bad = run_cli("distill", "--head", "--target", d, "--out", str(out), "--prompts", str(tmp_path / "empty.txt"))
    assert bad.returncode == 2 and "no prompts" in bad.stderr
    other = run_cli("generate", "--model", str(ckpt("qwen2")), "--prompt", "x", "--draft", f"head:{out}")
    assert other.returncode == 2 and "trained for another model" in other.stderr


def test_info_names_the_kernel_path_and_measures_verify_costs(ckpt, capsys):
    import os
    import subprocess
    import sys

    from exactspec.cli import main
    from exactspec.receipt import NUMERICS_VERSION
    assert main(["info", "--model", str(ckpt("llama"))]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["numerics_version"] == NUMERICS_VERSION and d["threads"] >= 1 and d["cpu"]
    assert list(d["forward_k_rows_over_1"]) == [str(k) for k in range(2, 10)]
    assert all(v >= 1.0 for v in d["forward_k_rows_over_1"].values())
    code = "from exactspec.cli import info; import json; print(json.dumps(info()))"
    for target, path in (("haswell", "AVX2 vpmaddubsw + vpmaddwd"), ("alderlake", "AVX-VNNI vpdpbusd (256-bit)"),
                         ("generic", "widening multiplies (no AVX2)")):
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NUMBA_CPU_NAME=target),
                           capture_output=True, text=True, check=True)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        assert (d["numba_target"], d["integer_dot"]) == (target, path)
