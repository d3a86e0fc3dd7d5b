"""Bad input: a specific exception whose message names the file / tensor / parameter; CLI exit 2."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import exactspec
from tests.helpers import run_cli
from exactspec import (CheckpointError, ContextLengthError, InvalidRequest, UnsupportedModelError,
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
    from exactspec.tools.testing import hf_model
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


# Every bad generation input: (call, exception, field, message). One check (request.make_request,
# check_prompt) raises them all; the model keeps working afterwards (nothing half-done).
BAD_INPUTS = [
    (lambda m: m.generate(list(range(2, 22)), 1), ContextLengthError, "prompt",
     "maximum context length is 16 tokens; the request needs 21 (20 in the prompt + 1 new)"),
    (lambda m: m.generate([2, 3, 4], 14), ContextLengthError, "max_new_tokens", "needs 17 (3 in the prompt + 14 new)"),
    (lambda m: m.generate_batch([[2], list(range(2, 30))], 1), ContextLengthError, "prompt", "in the prompt 1"),
    (lambda m: m.logits(list(range(2, 22))), ContextLengthError, "token_ids", "needs 20 (20 in the token_ids)"),
    (lambda m: m.logits([-1, 5]), InvalidRequest, "token_ids", "token id -1 outside the vocabulary [0, 320)"),
    (lambda m: m.logits([999]), InvalidRequest, "token_ids", "token id 999 outside the vocabulary"),
    (lambda m: m.generate([1, 999], 2), InvalidRequest, "prompt", "token id 999 outside the vocabulary"),
    (lambda m: m.generate([], 2), InvalidRequest, "prompt", "prompt is empty"),
    (lambda m: m.generate([1, 2.5], 2), InvalidRequest, "prompt", "token ids must be integers, got 2.5"),
    (lambda m: m.generate([1, True], 2), InvalidRequest, "prompt", "token ids must be integers, got True"),
    (lambda m: m.generate(None, 2), InvalidRequest, "prompt", "expected a list of int token ids, got NoneType"),
    (lambda m: m.generate([3], -3), InvalidRequest, "max_new_tokens", "max_new_tokens=-3"),
    (lambda m: m.generate([3], 1.5), InvalidRequest, "max_new_tokens", "max_new_tokens=1.5"),
    (lambda m: m.generate([3], "5"), InvalidRequest, "max_new_tokens", "max_new_tokens='5'"),
    (lambda m: m.generate([3], 2, temperature=-0.5), InvalidRequest, "temperature", "temperature=-0.5"),
    (lambda m: m.generate([3], 2, temperature=float("nan")), InvalidRequest, "temperature", "temperature=nan"),
    (lambda m: m.generate([3], 2, temperature="hot"), InvalidRequest, "temperature", "temperature='hot'"),
    (lambda m: m.generate([3], 2, top_p=0.0), InvalidRequest, "top_p", "top_p=0.0: must be in (0, 1]"),
    (lambda m: m.generate([3], 2, top_p=1.5), InvalidRequest, "top_p", "top_p=1.5"),
    (lambda m: m.generate([3], 2, top_p="x"), InvalidRequest, "top_p", "top_p='x'"),
    (lambda m: m.generate([3], 2, top_k=-1), InvalidRequest, "top_k", "top_k=-1"),
    (lambda m: m.generate([3], 2, top_k=2.5), InvalidRequest, "top_k", "top_k=2.5"),
    (lambda m: m.generate([3], 2, min_p=2.0), InvalidRequest, "min_p", "min_p=2.0"),
    (lambda m: m.generate([3], 2, repetition_penalty=0), InvalidRequest, "repetition_penalty", "repetition_penalty=0"),
    (lambda m: m.generate([3], 2, seed=-1), InvalidRequest, "seed", "seed=-1"),
    (lambda m: m.generate([3], 2, seed=2 ** 63), InvalidRequest, "seed", "seed=9223372036854775808"),
    (lambda m: m.generate([3], 2, seed="x"), InvalidRequest, "seed", "seed='x'"),
    (lambda m: m.generate_batch([[3], [4]], 2, seed=[1]), InvalidRequest, "seed", "1 seeds for 2 prompts"),
    (lambda m: m.generate_batch("abc", 2), InvalidRequest, "prompts", "takes a list of prompts"),
    (lambda m: m.generate([3], 2, draft="lookup", num_draft_tokens=-1), InvalidRequest, "num_draft_tokens",
     "num_draft_tokens=-1"),
    (lambda m: m.generate([3], 2, draft="lookup", num_draft_tokens="lots"), InvalidRequest, "num_draft_tokens",
     "num_draft_tokens='lots'"),
    (lambda m: m.generate([3], 2, draft="medusa"), InvalidRequest, "draft", "draft='medusa': unknown drafter"),
    (lambda m: m.generate([3], 2, draft=m, draft_confidence=1.5), InvalidRequest, "draft_confidence",
     "draft_confidence=1.5"),
    (lambda m: m.generate([3], 2, draft="lookup", lookup_max_ngram=0), InvalidRequest, "lookup_max_ngram",
     "min_ngram (1) <= max_ngram (0)"),
    (lambda m: exactspec.set_num_threads(0), InvalidRequest, "threads", "threads=0: must be an integer from 1"),
    (lambda m: exactspec.load(m.folder, max_context=1), InvalidRequest, "max_context", "max_context=1"),
]


@pytest.mark.parametrize("call,exc,field,message", BAD_INPUTS, ids=[b[3][:40] for b in BAD_INPUTS])
def test_every_bad_input_is_one_named_error(ckpt, call, exc, field, message):
    m = exactspec.load(ckpt("llama"), max_context=16)
    with pytest.raises(exc) as e:
        call(m)
    assert type(e.value) is exc and e.value.field == field and message in str(e.value), str(e.value)
    assert len(m.generate([3, 4], 4, ignore_eos=True).token_ids) == 4  # nothing half-done


def test_token_ids_of_any_integer_type(ckpt):
    import numpy as np
    m = exactspec.load(ckpt("llama"))
    want = m.generate([3, 4, 5], 6).token_ids
    for ids in (np.array([3, 4, 5]), torch.tensor([3, 4, 5]), [np.int64(3), np.int32(4), 5], (3, 4, 5)):
        assert m.generate(ids, 6).token_ids == want
    assert torch.equal(m.logits(np.array([3, 4, 5])), m.logits([3, 4, 5]))


def test_only_request_checks_the_context():
    """One context-length check in the package: request.check_prompt (the forward's guard is not an input check)."""
    import pathlib
    pkg = pathlib.Path(exactspec.__file__).parent
    hits = [f"{p.relative_to(pkg).as_posix()}:{i}" for p in sorted(pkg.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if "raise ContextLengthError(" in line]
    assert hits == [hits[0]] and hits[0].startswith("decode/request.py:"), hits


def test_seed_none_works_greedy_and_sampled(ckpt):
    m = exactspec.load(ckpt("llama"))
    assert m.generate([3, 4], 8, seed=None).token_ids == m.generate([3, 4], 8).token_ids
    r = m.generate([3, 4], 8, seed=None, temperature=1.0, ignore_eos=True)
    assert m.generate([3, 4], 8, seed=r.stats.seed, temperature=1.0, ignore_eos=True).token_ids == r.token_ids


def test_text_without_tokenizer(copy):
    d = copy()
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer \(tokenizer.json"):
        exactspec.load(d).generate("hello", max_new_tokens=2)


def test_draft_with_another_vocabulary(ckpt):
    m = exactspec.load(ckpt("llama"))
    other = exactspec.load(ckpt("llama", seed_vocab=256, tokenizer=False))
    with pytest.raises(InvalidRequest, match="vocabulary size 256 differs from the target's 320"):
        m.generate([3, 4], max_new_tokens=4, draft=other)


@pytest.mark.slow  # subprocesses
def test_cli_errors_are_one_line_exit_2(ckpt, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing: no such file or directory" in r.stderr
    r = run_cli("generate", "--model", str(ckpt("llama")), "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2 and "temperature=-1.0" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--model", str(ckpt("llama")), "--prompt", "x", "--draft", str(tmp_path))
    assert r.returncode == 2 and "config.json not found" in r.stderr
    r = run_cli("serve", "--model", str(ckpt("llama")), "--replicas", "2")  # a Ray flag without --ray
    assert r.returncode == 2 and "--replicas, --max-replicas and --ray-address go with --ray" in r.stderr
    r = run_cli("serve", "--model", str(ckpt("llama")), "--ray", "--cpus-per-replica", "0")
    assert r.returncode == 2 and "--cpus-per-replica 0: must be >= 1" in r.stderr and "Traceback" not in r.stderr


# Checkpoint files of the wrong types: (file, content, message). A named CheckpointError, never a traceback.
BAD_FILES = [
    ("config.json", {"hidden_size": [64]}, "field 'hidden_size' must be an int, got [64]"),
    ("config.json", {"num_attention_heads": None}, "field 'num_attention_heads' must be an int, got None"),
    ("config.json", {"vocab_size": "320"}, "field 'vocab_size' must be an int, got '320'"),
    ("config.json", {"rms_norm_eps": "small"}, "field 'rms_norm_eps' must be a float"),
    ("config.json", {"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be a bool"),
    ("config.json", {"eos_token_id": 1.5}, "field 'eos_token_id': expected a token id or a list of token ids, got 1.5"),
    ("config.json", {"eos_token_id": [[1, 2]]}, "field 'eos_token_id': expected a token id"),
    ("config.json", {"rope_parameters": "fast"}, "field 'rope_parameters' must be an object"),
    ("config.json", {"architectures": "LlamaForCausalLM"}, "field 'architectures' must be a list"),
    ("config.json", {"hidden_size": 0}, "field 'hidden_size' must be >= 1"),
    # issue 40: numbers a model cannot have (Python's json reads NaN and Infinity)
    ("config.json", {"rope_theta": float("nan"), "rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     "rope_theta is nan; expected a finite number > 0"),
    ("config.json", {"rms_norm_eps": -1e-5}, "rms_norm_eps is -1e-05; expected a finite number >= 0"),
    ("config.json", {"rms_norm_eps": float("inf")}, "rms_norm_eps is inf"),
    ("config.json", {"num_key_value_heads": 3}, "num_key_value_heads is 3; the 4 query heads (num_attention_heads) "
                                                "must be a whole multiple of it"),
    ("config.json", {"head_dim": 15}, "head_dim is 15; expected an even head size"),
    ("config.json", [1, 2], "config.json: expected a JSON object, got list"),
    ("config.json", b"\xff\xfe{}", "config.json: not UTF-8 text"),
    ("generation_config.json", {"eos_token_id": 1.0}, "generation_config.json: field 'eos_token_id'"),
    ("generation_config.json", {"eos_token_id": [1, None]}, "generation_config.json: field 'eos_token_id'"),
    ("generation_config.json", b"\xff", "generation_config.json: not UTF-8 text"),
    ("generation_config.json", "null", "generation_config.json: expected a JSON object, got NoneType"),
    ("tokenizer_config.json", [1], "tokenizer_config.json: expected a JSON object, got list"),
    ("tokenizer_config.json", b"{\xff}", "tokenizer_config.json: not UTF-8 text"),
]


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[f"{b[0]}:{b[2][:30]}" for b in BAD_FILES])
def test_checkpoint_files_of_wrong_types_are_named(copy, name, content, message):
    d = copy()
    path = d / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, dict):
        path.write_text(json.dumps({**json.loads(path.read_text()), **content}))
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CheckpointError) as e:
        exactspec.load(d)
    assert message in str(e.value), str(e.value)
    assert _cli_main(["generate", "--model", str(d), "--prompt", "x"]) == 2


def test_draft_with_a_shorter_context_stops_drafting_at_its_end(ckpt):
    target = exactspec.load(ckpt("llama"), max_context=64)
    draft = exactspec.load(ckpt("llama"), max_context=20)  # the same weights: every draft is accepted
    plain = target.generate([3, 4, 5], None, ignore_eos=True)
    r = target.generate([3, 4, 5], None, ignore_eos=True, draft=draft, num_draft_tokens=4)
    assert r.token_ids == plain.token_ids and len(r.token_ids) == 61
    assert 0 < r.stats.accepted < 58  # drafts while the sequence fits the draft's 20 positions, then none


def _cli_main(argv):
    from exactspec.cli import main
    return main(argv)


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", "x", "--threads", "0"], "threads=0"),
    (["serve", "--threads", "0"], "threads=0"),
    (["serve", "--max-queue", "0"], "--max-queue 0: must be > 0"),
    (["serve", "--max-batch", "0"], "--max-batch 0: must be > 0"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature=-1.0"),
    (["generate", "--prompt", "x", "--top-p", "2"], "top_p=2.0"),
    (["generate", "--prompt", "x", "--seed", "-4"], "seed=-4"),
    (["generate", "--prompt", "x", "--max-new-tokens", "-1"], "max_new_tokens=-1"),
    (["generate", "--prompt", "x " * 1100, "--max-new-tokens", "4"], "maximum context length is 1024"),
    (["generate", "--prompt", "x", "--draft", "lookup", "--num-draft-tokens", "0", "--top-k", "-2"], "top_k=-2"),
])
def test_cli_bad_inputs_exit_2_with_one_line(ckpt, capsys, args, message):
    cmd, rest = args[0], args[1:]
    assert _cli_main([cmd, "--model", str(ckpt("llama")), *rest]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_non_finite_weights_in_a_folder_are_named(copy):
    """Issue 40: a NaN weight loaded silently and greedy decoding gave [0, 0, 0, 0]."""
    d = copy()
    f = d / "model.safetensors"
    t = load_file(f)
    t["model.layers.1.mlp.down_proj.weight"][2, 3] = float("nan")
    t["model.layers.1.mlp.down_proj.weight"][4, 5] = float("-inf")
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"model.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight' "
                                          r"holds 2 NaN or infinite values"):
        exactspec.load(d)
