"""The shipped demo pair and the training / distillation path."""
import io
import subprocess
import sys

import pytest

import exactspec
from exactspec.tools.demo import demo_folder, run


@pytest.mark.skipif(not (demo_folder() / "draft" / "config.json").is_file(), reason="demo pair not trained yet")
def test_demo_pair_loads_and_speculative_output_is_identical():
    buf = io.StringIO()
    rows = run(max_new_tokens=24, out=buf, toy=True)
    assert [r["method"] for r in rows] == ["plain greedy", "draft model", "prompt lookup"]
    assert all(r["identical"] for r in rows)
    assert "identical to plain greedy" in buf.getvalue()
    t = exactspec.load(demo_folder() / "target")
    d = exactspec.load(demo_folder() / "draft")
    assert t.cfg.vocab_size == d.cfg.vocab_size and t.tokenizer.vocab_size == d.tokenizer.vocab_size
    from safetensors.torch import load_file

    def params(folder):
        return sum(v.numel() for f in folder.glob("*.safetensors") for v in load_file(f).values())
    assert 10e6 <= params(demo_folder() / "target") <= 25e6
    assert 1e6 <= params(demo_folder() / "draft") <= 3e6


def test_smollm2_demo_chats_and_is_identical(smollm2):
    buf = io.StringIO()
    rows = run(max_new_tokens=32, out=buf)
    assert [r["method"] for r in rows] == ["plain greedy", "head + lookup", "head", "prompt lookup",
                                             "draft model"]
    assert all(r["identical"] for r in rows)
    assert "SmolLM2-135M-Instruct" in buf.getvalue() and "acc" in buf.getvalue()  # the code-edit answer
    assert "q4_1" in buf.getvalue() and "int8 activations" in buf.getvalue()  # as the server runs the file


def test_demo_offline_without_cache_says_so_and_runs_the_toy_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache, and no download allowed
    buf = io.StringIO()
    rows = run(max_new_tokens=8, out=buf, download=False)
    assert "SmolLM2 unavailable" in buf.getvalue() and "toy pair" in buf.getvalue()
    assert all(r["identical"] for r in rows)


def test_distill_cli_makes_a_loadable_draft_with_the_targets_tokenizer(ckpt, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    (corpus / "b.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    out = tmp_path / "draft"
    target = ckpt("llama", tie_word_embeddings=True)
    r = subprocess.run([sys.executable, "-m", "exactspec.cli", "distill", "--target", str(target), "--corpus",
                        str(corpus), "--out", str(out), "--minutes", "0.05", "--hidden", "32", "--layers", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    draft = exactspec.load(out)
    model = exactspec.load(target)
    assert draft.cfg.vocab_size == model.cfg.vocab_size and draft.cfg.n_layers == 1
    plain = model.generate("def add", 30, ignore_eos=True)
    assert model.generate("def add", 30, ignore_eos=True, draft=draft).token_ids == plain.token_ids


def test_distill_rejects_a_missing_corpus(ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "exactspec.cli", "distill", "--target", str(ckpt("llama")), "--corpus",
                        str(tmp_path / "none"), "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "not a directory" in r.stderr
