"""exactspec.diff / `exactspec diff`: first divergence of two greedy runs, and whether numerics explain it."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import exactspec.hf as H
from exactspec.hf import diff
from exactspec.cli import main
from exactspec.errors import InvalidRequest
from exactspec.tools.testing import random_model

tf.logging.set_verbosity_error()


def prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model, ids: list[int], n: int = 128) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0].tolist()


@pytest.fixture(scope="module")
def bf16_model():
    return random_model("llama", dtype=torch.bfloat16, hidden=256)


def test_transformers_own_drift_is_diagnosed_as_a_near_tie(bf16_model):
    for seed in range(4):
        for setting in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": bf16_model}):
            r = diff.compare(bf16_model, prompt(seed), {}, setting, max_new_tokens=256)
            if r["diverged"]:
                break
        if r["diverged"]:
            break
    assert r["diverged"], "no divergence between transformers' greedy and assisted/lookup runs here"
    assert r["verdict"] == diff.NEAR_TIE, r
    p = r["position"]
    assert r["tokens_a"][:p - 12] == r["tokens_b"][:p - 12] and r["token_a"]["id"] != r["token_b"]["id"]
    assert 0 < r["noise"] and r["logit_difference"] <= r["noise_bound"]
    assert r["top2_a"][0]["logit"] - r["top2_a"][1]["logit"] == pytest.approx(r["top2_gap_a"])
    # from the token ids alone, the same position and verdict
    e = diff.explain(bf16_model, [*prompt(seed), *r["tokens_a"]], [*prompt(seed), *r["tokens_b"]], prompt_len=12)
    assert e["position"] == p and e["verdict"] == diff.NEAR_TIE


def test_patched_model_has_zero_noise_so_a_swapped_token_is_not_numerics(bf16_model):
    ids = prompt(0)
    with H.patch(bf16_model):
        a = greedy(bf16_model, ids)
        r = diff.compare(bf16_model, ids, {}, {"prompt_lookup_num_tokens": 4}, max_new_tokens=128)
        assert not r["diverged"] and r["tokens_a"] == a[12:]
        b = list(a)
        b[40] = next(t for t in range(2, 320) if t != a[40])  # a run that took another token at 40
        e = diff.explain(bf16_model, a, b, prompt_len=12)
    assert e["noise"] == 0.0  # every recomputation bitwise equal
    assert all(c["max_abs_difference_from_whole_prefix"] == 0.0 for c in e["computations"].values())
    assert e["position"] == 40 and e["new_token_index"] == 28 and e["verdict"] == diff.NOT_NUMERICS


def test_a_clearly_wrong_token_is_not_numerics_even_unpatched():
    model = random_model("llama", near_ties=False)
    a = greedy(model, prompt(1), 40)
    with torch.no_grad():
        worst = int(model(torch.tensor([a[:30]])).logits[0, -1].argmin())
    b = a[:30] + [worst] + a[31:]
    e = diff.explain(model, a, b, prompt_len=12)
    assert e["verdict"] == diff.NOT_NUMERICS and e["gap_a_minus_b"] > e["noise_bound"]
    assert "cache, position or masking" in e["reason"]


class BanArgmaxAt(tf.LogitsProcessor):
    """A logic bug: at one length, the best token is banned."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length:
            scores = scores.clone()
            scores[0, scores[0].argmax()] = -float("inf")
        return scores


def test_a_run_that_skips_its_own_argmax_is_not_numerics():
    model = random_model("llama", near_ties=False)
    bug = {"logits_processor": tf.LogitsProcessorList([BanArgmaxAt(20)])}
    r = diff.compare(model, prompt(2), {}, bug, max_new_tokens=32)
    assert r["diverged"] and r["position"] == 20
    assert r["verdict"] == diff.NOT_NUMERICS and r["margin_b"] < 0
    assert "did not choose the argmax" in r["reason"]


def test_identical_and_prefix_runs_and_bad_input():
    a = [5, 6, 7, 8]
    assert diff.first_divergence(a, a) is None and diff.first_divergence(a, [5, 6, 9]) == 2
    model = random_model("llama", near_ties=False)
    assert diff.explain(model, a, a[:3], prompt_len=2)["detail"].startswith("one sequence is a prefix")
    with pytest.raises(InvalidRequest, match="inside the prompt"):
        diff.explain(model, a, [5, 9, 7, 8], prompt_len=3)
    with pytest.raises(InvalidRequest, match="do_sample"):
        diff.compare(model, a, {}, {"do_sample": True}, max_new_tokens=4)
    with pytest.raises(InvalidRequest, match="needs --draft"):
        diff.parse_setting("assisted")
    with pytest.raises(InvalidRequest, match="'lookup:x'"):
        diff.parse_setting("lookup:x")


def test_cli_prints_a_json_report(ckpt, capsys):
    folder = ckpt("llama")
    ids = ",".join(map(str, prompt(3)))
    assert main(["diff", "--model", str(folder), "--prompt-ids", ids, "--b", "lookup:3", "--patch",
                 "--max-new-tokens", "64"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["diverged"] is False and len(r["tokens_a"]) == 64 and r["settings"]["patched"] is True
    assert main(["diff", "--model", str(folder), "--prompt", "def fibonacci(n):", "--b", "assisted:3",
                 "--draft", str(folder), "--max-new-tokens", "16", "--patch"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert not r["diverged"] and isinstance(r["text_a"], str)
    a = [int(t) for t in ids.split(",")] + [1, 2, 3]
    b = a[:-2] + [4, 5]
    assert main(["diff", "--model", str(folder), "--tokens-a", ",".join(map(str, a)),
                 "--tokens-b", " ".join(map(str, b)), "--prompt-len", "12"]) == 0
    r = json.loads(capsys.readouterr().out)
    # tokens 2 and 4 are no near-tie twins (those are 2k, 2k+1): a random-logit gap, far beyond any rounding noise
    assert r["position"] == 13 and r["verdict"] == diff.NOT_NUMERICS, r
    assert abs(r["gap_a_minus_b"]) > r["noise_bound"] and "whole prefix in one call" in r["computations"]


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent"], "/nonexistent: no such file or directory"),
    (["--prompt-ids", "1,2", "--b", "beam:4"], "expected greedy, assisted, assisted:K or lookup:N"),
    (["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated token ids"),
    ([], "give exactly one of --prompt and --prompt-ids"),
    (["--tokens-a", "1,2"], "--tokens-a and --tokens-b go together"),
])
def test_cli_errors_are_one_line(ckpt, capsys, args, message):
    base = ["diff", "--model", str(ckpt("llama"))]
    capsys.readouterr()  # making the checkpoint (on its first use) prints transformers' progress bar
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
