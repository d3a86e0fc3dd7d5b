"""The drafting head on the target's hidden states (decode/head.py, tools/head_train.py). Only the speed
depends on it: tokens (and logprobs) are plain decoding's for any k, sampling, batch, chunking,
prefix-cache hit and thread count. A head trained for another model is refused by name."""
import json
import shutil

import numpy as np
import pytest
import torch

import exactspec
from exactspec.tools import head_train as HT
from exactspec import kernels as K
from exactspec.decode import loop
from exactspec.decode.head import HeadDrafter, load_head
from exactspec.errors import CheckpointError, InvalidRequest
from exactspec.model.transformer import Rows

PROMPTS = [[5, 6, 7, 8], [100, 3, 100, 3, 9], list(range(20, 60)), [7] * 12]


@pytest.fixture(scope="module")
def trained(ckpt, tmp_path_factory):
    """A head trained for 150 steps on the tiny llama's own greedy outputs (its draft vocabulary
    128 of its 320 tokens: some targets cannot be drafted at all)."""
    m = exactspec.load(ckpt("llama"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(rng.integers(3, 20))).tolist() for _ in range(48)]
    out = tmp_path_factory.mktemp("head")
    meta = HT.distill_head(m, out, prompts, record_minutes=1.0, train_minutes=0.25, draft_vocab_size=128, max_new=40,
                             steps=150)  # a step count, not a time budget: the same head on any machine
    return m, out, meta


def test_hidden_states_and_input_rows_leave_the_logits_alone(ckpt):
    m = exactspec.load(ckpt("llama"))
    net = m.net
    rows = Rows()
    rows.add(0, PROMPTS[2], 0, logits_from=0)
    plain = rows.forward(net, net.new_cache(1, 64))
    hidden = np.empty((len(PROMPTS[2]), net.cfg.hidden_size), np.float32)
    x = net.embed_rows(torch.tensor(PROMPTS[2])).numpy()
    got = rows.forward(net, net.new_cache(1, 64), x_in=x, hidden=hidden)
    assert torch.equal(got, plain)
    assert torch.equal(K.linear(torch.from_numpy(hidden), net.lm_head), plain)  # the states the head reads
    twin = np.empty_like(hidden)  # the readable twin takes and gives the same
    t = torch.tensor(PROMPTS[2])
    ref = net.forward_ref(t, torch.zeros_like(t), torch.arange(len(t)), net.new_cache(1, 64), None, x, twin)
    assert torch.equal(ref, plain) and np.array_equal(twin, hidden)


def test_recorded_states_are_the_forward_of_the_transcript(trained):
    m, _, _ = trained
    data = HT.record(m, PROMPTS[:2], minutes=1.0, max_new=20)
    for toks, st in data:
        rows = Rows()
        rows.add(0, toks[:-1].tolist(), 0, logits_from=0)
        hidden = np.empty((len(toks) - 1, m.cfg.hidden_size), np.float32)
        rows.forward(m.net, m.net.new_cache(1, len(toks)), hidden=hidden)
        assert np.array_equal(hidden.astype(np.float16), st)


def test_the_trained_head_is_saved_with_its_figures(trained):
    m, out, meta = trained
    assert meta["draft_vocab"] == 128 and len(meta["acceptance_by_position"]) == 6 and meta["steps"] > 0
    assert json.loads((out / "head.json").read_text())["target"]["vocab_size"] == m.cfg.vocab_size
    assert (out / "training.png").stat().st_size > 1000


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_head_drafts_change_speed_never_tokens(trained, temperature, monkeypatch):
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: np.ones(17))  # the "auto" k: not a timing
    m, out, _ = trained
    kw = dict(temperature=temperature, seed=5, ignore_eos=True, logprobs=2)
    plain = m.generate_batch(PROMPTS, 48, **kw)
    want = [(r.token_ids, [(x.token, x.logprob, x.top) for x in r.logprobs]) for r in plain]
    accepted = 0
    for k in (1, 3, 8, "dynamic", "auto"):
        for draft in (f"head:{out}", f"head:{out}+lookup", f"pool+head:{out}"):
            got = m.generate_batch(PROMPTS, 48, draft=draft, num_draft_tokens=k, **kw)
            assert [(r.token_ids, [(x.token, x.logprob, x.top) for x in r.logprobs]) for r in got] == want, (k, draft)
            accepted += sum(r.stats.accepted for r in got)
        alone = m.generate(PROMPTS[2], 48, draft=f"head:{out}", num_draft_tokens=k, **kw)
        assert alone.token_ids == want[2][0], k
    if temperature == 0.0:
        assert accepted > 0  # the accept and roll-back paths both ran


def test_tree_verification_changes_speed_never_tokens(trained, monkeypatch):
    """Siblings of the head's first draft verified beside it (every time: rows cost nothing here), in a
    ragged batch and alone, chunked prompts and prefix-cache hits: plain decoding's tokens and logprobs;
    some siblings win (their keys swapped in), and no helper keeps a block."""
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: np.ones(17))  # every sibling pays
    monkeypatch.setattr(HeadDrafter, "cost_per_token", lambda self, target: 0.1)  # not this machine's timings
    monkeypatch.setattr(HeadDrafter, "catch_up", lambda self, target: 0.0)
    m, out, _ = trained
    plain = m.generate_batch(PROMPTS, 48, ignore_eos=True, logprobs=2)
    want = [(r.token_ids, [(x.token, x.logprob, x.top) for x in r.logprobs]) for r in plain]
    won = 0
    for k in (1, 3, "auto"):
        for draft in (f"head:{out}", f"head:{out}+lookup"):
            got = m.generate_batch(PROMPTS, 48, ignore_eos=True, logprobs=2, draft=draft, num_draft_tokens=k,
                                   draft_branches=3)
            assert [(r.token_ids, [(x.token, x.logprob, x.top) for x in r.logprobs]) for r in got] == want, (k, draft)
            assert sum(r.stats.siblings for r in got) > 0
            won += sum(r.stats.sibling_accepted for r in got)
    assert won > 0  # the swap path ran
    batch = loop.Batch(m.net, 3, 128, HeadDrafter(m.head(str(out)), m.net), prefill_chunk=7, prefix_blocks=8,
                       branches=2)
    for rnd in range(2):  # the second round starts in the first's shared blocks
        seqs = [batch.add(m.request(p, 48, ignore_eos=True, num_draft_tokens=2)) for p in PROMPTS[1:]]
        while batch.running:
            batch.step()
        assert [s.generated for s in seqs] == [w[0] for w in want[1:]], rnd
    assert sorted(batch._helpers) == [3, 4, 5] and batch.cache.blocks_used == batch.prefix.blocks


def observed(trained, seq: list[int]) -> HeadDrafter:
    """A head drafter in slot 0 that has seen the target's states of seq's committed positions."""
    m, out, _ = trained
    d = HeadDrafter(m.head(str(out)), m.net)
    d.begin(1, 128)
    rows = Rows()
    rows.add(0, seq[:-1], 0, logits_from=0)
    hidden = np.empty((len(seq) - 1, m.cfg.hidden_size), np.float32)
    rows.forward(m.net, m.net.new_cache(1, 128), hidden=hidden)
    d.observe(0, 0, hidden)
    return d


def test_a_repeated_proposal_drafts_the_same(trained):
    """Proposed for twice without a verify between (the loop retries a failed step alone): the same drafts."""
    from exactspec.decode.sampling import SamplingParams
    seq = PROMPTS[2]
    d = observed(trained, seq)
    first = d.propose([0], [seq], [4], [SamplingParams()])
    assert len(first[0]) == 4 and d.propose([0], [seq], [4], [SamplingParams()]) == first


def test_the_head_reports_the_rows_it_catches_up_on(trained, monkeypatch):
    """Its first forward feeds every state it has not fed (after a pause: tens): cost.observe_drafting
    is told the rows, so they are priced per row, not booked as drift of its one-row step."""
    from exactspec.decode import head as head_module
    from exactspec.decode.sampling import SamplingParams
    seq = PROMPTS[2]
    d = observed(trained, seq)
    seen = []
    monkeypatch.setattr(head_module, "observe_drafting", lambda net, s, forwards, rows, cal: seen.append((forwards, rows)))
    d.propose([0], [seq], [3], [SamplingParams()])
    assert seen == [(3, len(seq) - 1 + 2)]  # every state, then one row a draft


def test_head_with_chunked_prompts_prefix_hits_and_one_thread(trained):
    m, out, _ = trained
    head = m.head(str(out))
    want = [r.token_ids for r in m.generate_batch(PROMPTS, 30, ignore_eos=True)]
    for threads in (1, 2):
        K.set_num_threads(threads)
        try:
            batch = loop.Batch(m.net, 3, 128, HeadDrafter(head, m.net), prefill_chunk=7, prefix_blocks=8)
            for rnd in range(2):  # the second round starts in the first's shared blocks
                seqs = [batch.add(m.request(p, 30, ignore_eos=True, num_draft_tokens=4)) for p in PROMPTS[2:]]
                while batch.running:
                    batch.step()
                assert [s.generated for s in seqs] == want[2:], (threads, rnd)
            assert seqs[0].stats.cached_tokens > 0
        finally:
            K.set_num_threads(2)


def test_a_head_for_another_model_is_refused_by_name(trained, ckpt, tmp_path):
    m, out, _ = trained
    other = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))
    with pytest.raises(CheckpointError, match="trained for another model.*hidden_size"):
        load_head(out, other.net, other.tokenizer)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = json.loads((bad / "head.json").read_text())
    meta["target"]["vocab_sha256"] = "0" * 64
    (bad / "head.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="vocab_sha256"):
        m.generate(PROMPTS[0], 4, draft=f"head:{bad}")
    (bad / "head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no head.safetensors"):
        load_head(bad, m.net, m.tokenizer)
    with pytest.raises(InvalidRequest, match="distill --head"):
        m.generate(PROMPTS[0], 4, draft="head")  # none shipped for the tiny model
    with pytest.raises(InvalidRequest, match="join one of"):
        m.generate(PROMPTS[0], 4, draft="lookup+pool")


@pytest.mark.slow
def test_the_shipped_smollm2_head_drafts_exactly_and_is_accepted(smollm2):
    from exactspec.text import chat
    m = exactspec.load(smollm2, max_context=1024)
    prompts = [chat.render(m.tokenizer.config, [{"role": "user", "content": q}])
               for q in ("Explain recursion to a beginner.", "Write a Python function that reverses a string.")]
    want = [r.token_ids for r in m.generate_batch(prompts, 64)]
    got = m.generate_batch(prompts, 64, draft="head")
    assert [r.token_ids for r in got] == want
    s = [r.stats for r in got]
    assert sum(x.accepted for x in s) / sum(x.proposed for x in s) > 0.3
