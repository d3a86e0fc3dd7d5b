"""Where models come from: GGUF files with their tokenizer and chat template (library, CLI
generate/serve), hub ids through a pre-populated hub cache (offline), chat templates in the files
transformers 5 writes, and the real SmolLM2 file against transformers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import exactspec
from exactspec.text import chat
from exactspec.errors import CheckpointError
from exactspec.tools.testing import random_model
from tests.model.test_gguf import write_gguf

MSGS = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def gguf_and_folder(ckpt, tmp_path_factory):
    folder = ckpt("llama")
    path = write_gguf(random_model("llama"), tmp_path_factory.mktemp("g") / "tiny.gguf", tokenizer_folder=folder)
    return path, folder


def test_gguf_tokenizer_and_template_serve_text_prompts(gguf_and_folder):
    path, folder = gguf_and_folder
    g, f = exactspec.load(path), exactspec.load(folder)
    for text in ("def fibonacci(n):", "The quick brown fox", "Größe 日本語 🤖\n\n  x"):
        assert g.encode(text) == f.encode(text)
    assert chat.render(g.tokenizer.config, MSGS) == chat.render(f.tokenizer.config, MSGS)
    a = g.generate("def fibonacci(n):", 24, ignore_eos=True)
    assert a.token_ids == f.generate("def fibonacci(n):", 24, ignore_eos=True).token_ids
    assert a.text == f.generate("def fibonacci(n):", 24, ignore_eos=True).text


def test_cli_generate_takes_a_gguf_file(gguf_and_folder):
    path, folder = gguf_and_folder
    out = []
    for m in (path, folder):
        r = subprocess.run([sys.executable, "-m", "exactspec.cli", "generate", "--model", str(m), "--prompt", "def f(x):",
                            "--max-new-tokens", "12", "--ignore-eos", "--json", "--draft", "lookup"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(json.loads(r.stdout)["token_ids"])
    assert out[0] == out[1]


def test_serve_takes_a_gguf_file(gguf_and_folder):
    from tests.serve.serving import Running
    path, folder = gguf_and_folder
    s = Running(path)
    try:
        r = s.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
        want = exactspec.load(folder).generate(chat.render(exactspec.load(folder).tokenizer.config, MSGS), 16)
        assert r.choices[0].message.content == want.text
    finally:
        s.stop()


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json"])
def test_chat_template_beside_tokenizer_config(ckpt, tmp_path, where):
    """transformers 5 writes the template to chat_template.jinja (4.43+: chat_template.json), not
    into tokenizer_config.json; the separate file wins, as in transformers."""
    folder = tmp_path / "m"
    shutil.copytree(ckpt("llama"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(chat.TemplateError, match="no chat_template"):
        chat.render(exactspec.load(folder).tokenizer.config, MSGS)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    if where.endswith(".jinja"):
        (folder / where).write_text(template)
    else:
        (folder / where).write_text(json.dumps({"chat_template": template}))
    assert chat.render(exactspec.load(folder).tokenizer.config, MSGS) == "<<def add(a, b):>>"


def _hub_cache(root, repo: str, src) -> None:
    """The layout huggingface_hub's cache uses: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, base / "snapshots" / commit)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def test_hub_ids_load_from_the_hub_cache_offline(ckpt, tmp_path):
    folder = ckpt("llama")
    _hub_cache(tmp_path, "tiny-org/tiny-llama", folder)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = lambda model: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "exactspec.cli", "generate", "--model", model, "--prompt", "def f(x):",
         "--max-new-tokens", "10", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300, env=env)
    r = run("tiny-org/tiny-llama")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["token_ids"] == exactspec.load(folder).generate("def f(x):", 10,
                                                                               ignore_eos=True).token_ids
    r = run("tiny-org/not-cached")
    assert r.returncode == 2 and "tiny-org/not-cached: not a local path" in r.stderr and "Traceback" not in r.stderr


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        exactspec.load(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        exactspec.load("./org/name")


# -- the real model ------------------------------------------------------------------------------
PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Explain recursion in two sentences.", "List three prime numbers."]


def test_smollm2_greedy_equals_transformers(smollm2):
    """Our loader + kernels vs transformers' own GGUF loading of the same file, both float32:
    4 chat prompts x 64 greedy tokens, token for token."""
    import transformers as tf
    theirs = tf.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                     dtype=torch.float32).eval()
    ours = exactspec.load(smollm2, dtype="float32", max_context=512)
    for p in PROMPTS:
        ids = ours.encode(chat.render(ours.tokenizer.config, [{"role": "user", "content": p}]))
        with torch.no_grad():
            # the mask is explicit: the prompt holds <|im_end|>, the pad id, which transformers would mask out
            want = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=64, do_sample=False, eos_token_id=None,
                                   pad_token_id=2)[0, len(ids):].tolist()
        assert ours.generate(ids, 64, ignore_eos=True).token_ids == want, p


def test_smollm2_speculative_is_identical(smollm2):
    m = exactspec.load(smollm2, dtype="bfloat16", max_context=512)
    prompts = [chat.render(m.tokenizer.config, [{"role": "user", "content": p}]) for p in PROMPTS]
    plain = [r.token_ids for r in m.generate_batch(prompts, 48)]
    for k in (1, 4, "dynamic"):
        assert [r.token_ids for r in m.generate_batch(prompts, 48, draft="lookup", num_draft_tokens=k)] == plain
    assert m.generate(prompts[0], 48, draft="lookup").token_ids == plain[0]  # alone == in a batch
    from exactspec.tools.demo import demo_folder
    draft = exactspec.load(demo_folder() / "smollm2-draft", dtype="bfloat16")  # the shipped distilled draft
    from safetensors.torch import load_file
    assert 5e6 <= sum(v.numel() for v in load_file(demo_folder() / "smollm2-draft" / "model.safetensors").values()) <= 15e6
    for k in (3, "dynamic"):
        got = m.generate_batch(prompts, 48, draft=draft, num_draft_tokens=k)
        assert [r.token_ids for r in got] == plain and sum(r.stats.accepted for r in got) > 0


def test_cli_diff_takes_a_gguf_file(gguf_and_folder, capsys):
    from exactspec.cli import main
    path, _ = gguf_and_folder
    assert main(["diff", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "diverged" in report and isinstance(report["text_a"], str)


def test_a_symlink_loop_or_dangling_link_is_named_never_a_hub_id(tmp_path, monkeypatch):
    """Issue 27: `--model` at a symlink loop was taken for a hub id (and went to the network)."""
    import huggingface_hub

    def no_network(*a, **kw):
        raise AssertionError("a local path went to the hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(exactspec.CheckpointError, match="a: a symlink loop"):
        exactspec.load("a")  # "a" alone is not a hub id; "org/name" shaped is:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(tmp_path / "org" / "name")
    with pytest.raises(exactspec.CheckpointError, match="org/name: a symlink loop"):
        exactspec.load("org/name")
    (tmp_path / "org" / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(exactspec.CheckpointError, match="which does not exist"):
        exactspec.load("org/gone")
