"""Fuzzing the GGUF header and metadata parser (bounded: a few hundred files): a valid tiny file with
bytes overwritten, cut or inserted in its header and metadata, and metadata values of the wrong
type. Every input gives a clean result or a named ExactSpecError, never another exception."""
from __future__ import annotations

import random

import gguf
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from exactspec.errors import ExactSpecError
from exactspec.model.gguf_file import GGUFFile
from exactspec.tools.testing import random_model
from tests.model.test_gguf import write_gguf

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def valid(tmp_path_factory, ckpt):
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    write_gguf(random_model("qwen2", hidden=32, layers=1), path, tokenizer_folder=ckpt("qwen2"))
    return _Valid((path.read_bytes(), min(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors)))


class _Valid(tuple):
    """(the file's bytes, where its tensor data starts), shown short in a failure report."""

    def __repr__(self) -> str:
        return f"<a valid GGUF file of {len(self[0])} bytes, header {self[1]}>"


def _parse(path) -> None:
    """What loading reads before any weight: the header, the config, the tokenizer (and its template)."""
    try:
        f = GGUFFile(path)
        tok = f.tokenizer()
        if tok is not None:
            tok.decode(tok.encode("hello, world"))
    except ExactSpecError:
        pass


@SETTINGS
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 4))
def test_corrupt_headers_give_a_named_error_or_a_model(valid, tmp_path, seed, n):
    """n edits at uniformly random places of the header and metadata (hypothesis' own integers crowd
    near 0: the magic), each a few random bytes overwritten, cut or inserted."""
    raw, end = valid
    rnd = random.Random(seed)
    data = bytearray(raw)
    for _ in range(n):
        at, b = rnd.randrange(end), rnd.randbytes(rnd.randint(1, 8))
        kind = rnd.choice(["set", "set", "cut", "insert"])
        if kind == "set":
            data[at: at + len(b)] = b
        elif kind == "cut":
            del data[at: at + len(b)]
        else:
            data[at:at] = b
    path = tmp_path / "f.gguf"
    path.write_bytes(bytes(data))
    _parse(path)


values = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True, width=32),
                   st.text(max_size=20), st.lists(st.integers(0, 2 ** 31 - 1), max_size=5),
                   st.lists(st.text(max_size=5), max_size=5))
KEYS = ["general.architecture", "qwen2.block_count", "qwen2.embedding_length", "qwen2.attention.head_count",
        "qwen2.attention.head_count_kv", "qwen2.context_length", "qwen2.rope.freq_base",
        "qwen2.attention.layer_norm_rms_epsilon", "qwen2.feed_forward_length", "qwen2.vocab_size",
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template", "general.alignment"]


@SETTINGS
@given(key=st.sampled_from(KEYS), value=values)
def test_metadata_of_any_type_gives_a_named_error_or_a_model(tmp_path, ckpt, key, value):
    """One metadata value replaced by a value of any type (the writer picks the GGUF type from it)."""
    path = tmp_path / "f.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    model = random_model("qwen2", hidden=32, layers=1)
    c = model.config
    meta = {"qwen2.block_count": 1, "qwen2.embedding_length": 32, "qwen2.attention.head_count": c.num_attention_heads,
            "qwen2.attention.head_count_kv": c.num_key_value_heads, "qwen2.context_length": 64,
            "qwen2.rope.freq_base": 10000.0, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen2.feed_forward_length": c.intermediate_size, "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    meta[key] = value
    for k, v in meta.items():
        if k == "general.architecture" or v is None:
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            (w.add_uint32 if 0 <= v < 2 ** 32 else w.add_int64 if v < 2 ** 63 else w.add_uint64)(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif v and isinstance(v[0], str):
            w.add_array(k, v)
        elif v:
            w.add_array(k, v)
    for name, t in {"token_embd.weight": (c.vocab_size, 32), "output_norm.weight": (32,)}.items():
        import numpy as np
        w.add_tensor(name, np.zeros(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _parse(path)
