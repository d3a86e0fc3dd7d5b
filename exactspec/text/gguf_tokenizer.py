"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built as a HF
`tokenizers.Tokenizer` (the library does the encoding; this module only wires its parts).

Two kinds, the ones llama.cpp's Llama-family files use:
- "gpt2": byte-level BPE. Vocabulary and merges from the file; the split regex chosen by
  `tokenizer.ggml.pre` (llama.cpp's name for how the text was pre-split when the merges were
  learned); an unknown pre-split name is refused, not guessed.
- "llama": SentencePiece as BPE with byte fallback (`<0x0A>` tokens), "▁" for spaces, a space
  prepended to the text unless `add_space_prefix` is false; merges from the file, or, when it
  has none, derived from the vocabulary ranked by the merged piece's score.
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole. BOS/EOS are added by the post-processor when the file says
so (`add_bos_token`; SentencePiece files that do not say add BOS, as llama.cpp does).

The result equals transformers' own GGUF tokenizer (tests/test_gguf_tokenizer.py).
"""
from __future__ import annotations

from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..errors import CheckpointError, UnsupportedModelError

CONTROL, USER_DEFINED, UNKNOWN = 3, 4, 2  # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = None  # the ByteLevel pre-tokenizer's own regex (GPT-2's)
SPLITS: dict[str, str | None] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "smollm": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}

Field = Callable[[str, Any], Any]  # field(key, default) -> the metadata value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build(field: Field, where: str) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config-like dict with bos/eos tokens, add_bos_token, chat_template)."""
    kind = field("tokenizer.ggml.model", None)
    tokens = field("tokenizer.ggml.tokens", None)
    if kind is None or not tokens:
        raise CheckpointError(f"{where}: no tokenizer in the metadata (tokenizer.ggml.model / tokens); "
                              "pass prompts as token ids")
    types = list(field("tokenizer.ggml.token_type", None) or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    merges = field("tokenizer.ggml.merges", None)
    special_id = {k: field(f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos", "unknown", "padding")}
    for k, i in special_id.items():
        if i is not None and not 0 <= int(i) < len(tokens):
            raise CheckpointError(f"{where}: tokenizer.ggml.{k}_token_id={i} is outside the vocabulary "
                                  f"({len(tokens)} tokens)")
    if kind == "gpt2":
        tok = _byte_level(field, tokens, merges, where)
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece(field, tokens, merges, special_id["unknown"], where)
        add_bos = bool(field("tokenizer.ggml.add_bos_token", True))
    else:
        raise UnsupportedModelError(f"{where}: tokenizer.ggml.model={kind!r} is not supported (gpt2, llama)")
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None  # byte-level: tokens are spelled in it
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if (ty == CONTROL or (ty == UNKNOWN and kind == "llama")) and (alphabet is None or set(t) <= alphabet)]
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    add_eos = bool(field("tokenizer.ggml.add_eos_token", False))
    name = {k: (tokens[int(i)] if i is not None else None) for k, i in special_id.items()}
    _post_processor(tok, name["bos"] if add_bos else None, name["eos"] if add_eos else None, special_id)
    config = {"bos_token": name["bos"], "eos_token": name["eos"], "unk_token": name["unknown"],
              "pad_token": name["padding"], "add_bos_token": add_bos, "add_eos_token": add_eos}
    template = field("tokenizer.chat_template", None)
    if not template and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        template = GEMMA_TEMPLATE  # a Gemma file converted without its template (llama.cpp's "gemma" format)
    if template:
        config["chat_template"] = template
    return tok, config


# Gemma's own chat format (its tokenizer_config.json's template, text parts only), for Gemma files that carry
# none: a system message prefixes the first user turn; "assistant" is "model"; turns end with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string else "
    "messages[0]['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{{ message['content'] | map(attribute='text') | join('') | trim }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def _byte_level(field: Field, tokens: list[str], merges, where: str) -> Tokenizer:
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise UnsupportedModelError(f"{where}: tokenizer.ggml.pre={pre!r} (the text-splitting rule of this "
                                    f"vocabulary) is not supported ({', '.join(sorted(SPLITS))})")
    if not merges:
        raise CheckpointError(f"{where}: a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {}
    for i, t in enumerate(tokens):  # a token outside the byte alphabet (rare) is respelled in it
        vocab.setdefault(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")), i)
    tok = Tokenizer(_bpe(vocab, _pairs(merges, vocab, where), where, fuse_unk=False, byte_fallback=False))
    split = SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _pairs(merges, vocab: dict[str, int], where: str) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) pairs: each entry two pieces joined by one space, both
    pieces and their join in the vocabulary (the tokenizers library panics or raises a bare
    Exception deep inside otherwise)."""
    out = []
    for i, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else ()
        if len(parts) != 2 or not all(parts):
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{i}] is {m!r}, not two pieces joined by a space")
        missing = next((p for p in (*parts, parts[0] + parts[1]) if p not in vocab), None)
        if missing is not None:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{i}] ({m!r}) needs the token {missing!r}, which "
                                  "tokenizer.ggml.tokens does not have")
        out.append((parts[0], parts[1]))
    return out


def _bpe(vocab: dict[str, int], pairs: list[tuple[str, str]], where: str, **kw) -> models.BPE:
    """The BPE model, or CheckpointError if the tokenizers library refuses it anyway."""
    try:
        return models.BPE(vocab=vocab, merges=pairs, **kw)
    except BaseException as e:  # its errors are a bare Exception or a pyo3 PanicException (a BaseException)
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise CheckpointError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None


def _sentencepiece(field: Field, tokens: list[str], merges, unk_id, where: str) -> Tokenizer:
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges:
        pairs = _pairs(merges, vocab, where)
    else:
        scores = field("tokenizer.ggml.scores", None) or [0.0] * len(tokens)
        pairs = _merges_from_scores(tokens, vocab, scores)
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tok = Tokenizer(_bpe(vocab, pairs, where, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(tokens: list[str], vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; a merge ranks by the
    merged piece's score (higher first), then by longer left, longer right part; ties keep the
    order of (left id, right id) within a piece and of the pieces in the file."""
    ranked = []
    score = {}
    for t, s in zip(tokens, scores):
        score.setdefault(t, float(s))
    for piece, s in score.items():
        local = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in vocab and piece[j:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((s, len(lr[0]), len(lr[1]), lr) for lr in local)
    ranked.sort(key=lambda r: r[:3], reverse=True)  # stable: equal keys keep their order
    return [r[3] for r in ranked]


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None, ids: dict) -> None:
    if bos is None and eos is None:
        return
    head, tail = [bos] if bos else [], [eos] if eos else []
    pieces = [*([(bos, int(ids["bos"]))] if bos else []), *([(eos, int(ids["eos"]))] if eos else [])]
    tok.post_processor = processors.TemplateProcessing(single=[*head, "$A", *tail],
                                                       pair=[*head, "$A", *tail, *head, "$B:1", *tail],
                                                       special_tokens=pieces)
