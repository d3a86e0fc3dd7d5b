"""Bad input: a specific exception whose message names the file / tensor / parameter; CLI exit 2."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import exactspec
from exactspec import (CheckpointError, ContextLengthError, InvalidArgumentError, UnsupportedModelError,
                       WeightError)


@pytest.fixture
def copy(ckpt, tmp_path):
    def make(arch="llama"):
        dst = tmp_path / arch
        shutil.copytree(ckpt(arch), dst)
        return dst
    return make


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such file or directory"):
        exactspec.load(tmp_path / "nope")


def test_missing_config(copy):
    d = copy()
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        exactspec.load(d)


def test_corrupt_config(copy):
    d = copy()
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        exactspec.load(d)


def test_missing_weights(copy):
    d = copy()
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        exactspec.load(d)


def test_corrupt_safetensors(copy):
    d = copy()
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read"):
        exactspec.load(d)


def test_missing_tensor_is_named(copy):
    d = copy()
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(WeightError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        exactspec.load(d)


def test_wrong_shape_is_named(copy):
    d = copy()
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(t, d / "model.safetensors")
    with pytest.raises(WeightError, match=r"k_proj\.weight' has shape \(3, 64\), config\.json implies \(32, 64\)"):
        exactspec.load(d)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(ckpt, tmp_path):
    from models import hf_model
    d = tmp_path / "sharded"
    hf_model(ckpt("qwen3")).save_pretrained(d, max_shard_size="100KB")
    shutil.copy(ckpt("qwen3") / "tokenizer.json", d)
    assert (d / "model.safetensors.index.json").is_file()
    assert torch.equal(exactspec.load(d).logits([3, 4, 5]), exactspec.load(ckpt("qwen3")).logits([3, 4, 5]))
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard listed in model.safetensors.index.json"):
        exactspec.load(d)


def test_unsupported_architecture(copy):
    d = copy()
    c = json.loads((d / "config.json").read_text())
    c["architectures"], c["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        exactspec.load(d)


def test_unsupported_rope_and_activation(copy):
    d = copy()
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "hidden_act": "gelu"}))
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        exactspec.load(d)
    (d / "config.json").write_text(json.dumps({**c, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}))
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        exactspec.load(d)


def test_zero_layers(copy):
    d = copy()
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 0}))
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers=0"):
        exactspec.load(d)


def test_unsupported_dtype(ckpt):
    with pytest.raises(UnsupportedModelError, match="dtype='float16'"):
        exactspec.load(ckpt("llama"), dtype="float16")


def test_prompt_longer_than_context(ckpt):
    m = exactspec.load(ckpt("llama"), max_context=16)
    with pytest.raises(ContextLengthError, match="prompt 0 has 20 tokens; .* is 16"):
        m.generate(list(range(2, 22)), max_new_tokens=1)
    with pytest.raises(InvalidArgumentError, match="exceed max_context=16"):
        m.logits(list(range(2, 22)))


def test_bad_token_ids_and_text_without_tokenizer(copy):
    d = copy()
    m = exactspec.load(d)
    with pytest.raises(InvalidArgumentError, match="token id 999 outside the vocabulary"):
        m.generate([1, 999], max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match=r"token ids -1\.\.5 are outside the vocabulary \(0\.\.319\)"):
        m.logits([-1, 5])  # the kernels index raw memory: refused, not wrapped to the last id
    with pytest.raises(InvalidArgumentError, match="token ids 999..999"):
        m.logits([999])
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer \(tokenizer.json"):
        exactspec.load(d).generate("hello", max_new_tokens=2)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(min_p=2.0), "min_p=2.0"),
    (dict(draft="lookup", num_draft_tokens=-1), "num_draft_tokens=-1"),
    (dict(draft="lookup", num_draft_tokens="lots"), "num_draft_tokens='lots'"),
    (dict(draft="medusa"), "draft='medusa': unknown drafter"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
])
def test_bad_generation_arguments(ckpt, kw, msg):
    m = exactspec.load(ckpt("llama"))
    with pytest.raises(InvalidArgumentError, match=msg.replace("(", r"\(")):
        m.generate([3, 4], **{"max_new_tokens": 4, **kw})


def test_draft_with_another_vocabulary(ckpt):
    m = exactspec.load(ckpt("llama"))
    other = exactspec.load(ckpt("llama", seed_vocab=256, tokenizer=False))
    with pytest.raises(InvalidArgumentError, match="vocabulary size 256 differs from the target's 320"):
        m.generate([3, 4], max_new_tokens=4, draft=other)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "exactspec.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors_are_one_line_exit_2(ckpt, tmp_path):
    r = _cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing: no such file or directory" in r.stderr
    r = _cli("generate", "--model", str(ckpt("llama")), "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2 and "temperature=-1.0" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--model", str(ckpt("llama")), "--prompt", "x", "--draft", str(tmp_path))
    assert r.returncode == 2 and "config.json not found" in r.stderr
