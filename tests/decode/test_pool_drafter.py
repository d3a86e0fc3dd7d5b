"""The shared n-gram pool: prompt lookup first, then the n-grams of sequences decoded earlier (by any
request). Its drafts are only proposals: tokens stay those of plain decoding."""
import exactspec
from exactspec.decode.drafters import NgramPool


def test_pool_lookup_latest_and_bounded():
    pool = NgramPool(max_ngram=2, max_tokens=12)
    pool.add([1, 2, 3, 4, 5])
    pool.add([9, 2, 3, 7, 8])
    assert pool.find([0, 2, 3], 2)[0] == [7, 8]  # the latest occurrence of (2, 3)
    assert pool.find([0, 4], 3)[0] == [5]
    assert pool.find([6], 2)[0] == []
    pool.add([10, 11, 12, 13])  # over 12 tokens: the oldest sequence leaves, with its n-grams
    assert pool.find([0, 4], 3)[0] == [] and pool.find([0, 2, 3], 2)[0] == [7, 8]
    assert all(sid in pool.seqs for sid, _ in pool.index.values())


def test_pool_drafts_a_repeated_request_and_changes_no_token(ckpt):
    m = exactspec.load(ckpt("qwen3"))
    p = [5, 9, 11, 40, 41, 42, 7]
    for kw in (dict(), dict(temperature=0.8, seed=4)):
        plain = m.generate(p, 48, ignore_eos=True, **kw)
        first = m.generate(p, 48, ignore_eos=True, draft="pool", num_draft_tokens=6, **kw)
        again = m.generate(p, 48, ignore_eos=True, draft="pool", num_draft_tokens=6, **kw)
        assert plain.token_ids == first.token_ids == again.token_ids
        # the second time the pool holds the whole answer: most drafts accepted, far fewer forwards (not
        # all: where the answer repeats an n-gram, its latest occurrence may go on otherwise)
        assert again.stats.acceptance_rate > 0.7 and again.stats.forward_passes * 3 < plain.stats.forward_passes
    other = m.generate_batch([p, [3, 3, 4]], 20, draft="pool", num_draft_tokens=3, ignore_eos=True)
    assert [r.token_ids for r in other] == [r.token_ids for r in m.generate_batch([p, [3, 3, 4]], 20, ignore_eos=True)]
