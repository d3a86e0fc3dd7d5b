"""The tokenizer built from a GGUF file's metadata equals transformers' own GGUF tokenizer, for
both kinds (byte-level BPE, SentencePiece with and without merges), on a multilingual + code
sample; chat templates come from the file; bad tokenizer metadata is a named error."""
from __future__ import annotations

import gguf
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import exactspec
from exactspec.errors import CheckpointError, UnsupportedModelError
from exactspec.text.tokenizer import Tokenizer as ExactTokenizer

TEXTS = [
    "Hello world", "  two leading spaces\n\n\ttab and newline", "def f(x):\n    return x**2  # square\n",
    "Größe café naïve — “quotes” 日本語のテキスト 中文 한국어 Ελληνικά русский عربي हिन्दी 🤖🎉",
    "12345678901 3.14159 1e-9 0x1F", "it's we'll they'd I'M DON'T", "\x00\x01 \u200b zero width",
    "<s>special</s> inside <unk> text", "   ", "",
]
TRAIN_TEXT = (["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
               "Größe café naïve 日本語 русский", "import numpy as np\nx = np.zeros((3, 4))\n"] * 50)
CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _writer(path, model: str, tokens, types, merges=None, scores=None, **extra):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for k, v in extra.items():
        getattr(w, f"add_{k}")(v)  # e.g. add_tokenizer_pre, add_add_space_prefix
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_level_file(path, pre="gpt2"):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    import json
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return _writer(path, "gpt2", tokens, types, merges, tokenizer_pre=pre, bos_token_id=1, eos_token_id=2,
                   chat_template=CHAT)


def _sentencepiece_file(path, with_merges: bool, add_space_prefix: bool | None = None):
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    trained = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [t for t, _ in trained if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # earlier pieces (merged first) score higher
    import json
    merges = None
    if with_merges:
        merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    extra = dict(bos_token_id=1, eos_token_id=2, unk_token_id=0)
    if add_space_prefix is not None:
        extra["add_space_prefix"] = add_space_prefix
    return _writer(path, "llama", tokens, types, merges, scores, **extra)


def _ours(path) -> ExactTokenizer:
    r = gguf.GGUFReader(str(path))

    def field(k, default=None):
        f = r.fields.get(k)
        return default if f is None else f.contents()
    return ExactTokenizer.from_gguf(field, path)


def _assert_same_as_transformers(path, texts=TEXTS):
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = _ours(path)
    for t in texts:
        a, b = ours.encode(t), theirs(t).input_ids
        assert a == b, (t, a, b)
        assert ours.decode(a) == theirs.decode(b, skip_special_tokens=True), t
        assert ours.encode(t, add_special_tokens=False) == theirs(t, add_special_tokens=False).input_ids, t
    return ours


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_bpe_equals_transformers(tmp_path, pre):
    ours = _assert_same_as_transformers(_byte_level_file(tmp_path / "t.gguf", pre))
    assert ours.config["chat_template"] == CHAT and ours.config["eos_token"] == "<|im_end|>"
    assert ours.encode("<|im_start|>hi<|im_end|>")[0] == 1  # control tokens stay whole


@pytest.mark.parametrize("with_merges", [True, False])
def test_sentencepiece_equals_transformers(tmp_path, with_merges):
    ours = _assert_same_as_transformers(_sentencepiece_file(tmp_path / "s.gguf", with_merges))
    assert ours.encode("hi")[0] == 1  # add_bos_token defaults to true for SentencePiece files, as in llama.cpp
    assert "<0x" not in "".join(ours.tok.id_to_token(i) for i in ours.encode("plain ascii words"))


def test_sentencepiece_without_space_prefix(tmp_path):
    ours = _ours(_sentencepiece_file(tmp_path / "s.gguf", True, add_space_prefix=False))
    with_prefix = _ours(_sentencepiece_file(tmp_path / "p.gguf", True))
    assert ours.encode("hello", add_special_tokens=False) != with_prefix.encode("hello", add_special_tokens=False)
    assert ours.decode(ours.encode("hello world")) == "hello world"


def test_smollm2_tokenizer_equals_transformers(smollm2):
    _assert_same_as_transformers(smollm2, TEXTS + [open(exactspec.__file__).read()])


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre='made-up'"):
        _ours(_byte_level_file(tmp_path / "t.gguf", "made-up"))


def test_bad_tokenizer_metadata_is_named(tmp_path):
    p = _writer(tmp_path / "x.gguf", "gpt2", ["a", "b"], [1, 1], ["a b"], bos_token_id=7)
    with pytest.raises(CheckpointError, match=r"x.gguf: tokenizer.ggml.bos_token_id=7 is outside"):
        _ours(p)
    p = _writer(tmp_path / "y.gguf", "bert", ["a", "b"], [1, 1])
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model='bert'"):
        _ours(p)
    p = _writer(tmp_path / "z.gguf", "gpt2", ["a", "b"], [1])
    with pytest.raises(CheckpointError, match="token_type has 1 entries for 2 tokens"):
        _ours(p)


def test_merges_that_do_not_hold_together_are_named(tmp_path):
    """Issue 40: a merge that is not a pair ("abc"), and merges naming tokens the file does not have
    (tokens cut short): the CLI ended in a traceback from the tokenizers library."""
    p = _writer(tmp_path / "x.gguf", "gpt2", ["a", "b", "ab"], [1, 1, 1], ["a b", "abc"])
    with pytest.raises(CheckpointError, match=r"x.gguf: tokenizer.ggml.merges\[1\] is 'abc', not two pieces"):
        _ours(p)
    p = _writer(tmp_path / "y.gguf", "gpt2", ["a", "b", "ab"], [1, 1, 1], ["a b", "ab c"])
    with pytest.raises(CheckpointError, match=r"y.gguf: tokenizer.ggml.merges\[1\] \('ab c'\) needs the token 'c'"):
        _ours(p)
    p = _writer(tmp_path / "z.gguf", "llama", ["<unk>", "a", "b"], [2, 1, 1], ["a b c"])
    with pytest.raises(CheckpointError, match=r"z.gguf: tokenizer.ggml.merges\[0\] is 'a b c'"):
        _ours(p)
