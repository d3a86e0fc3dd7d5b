"""Text <-> token ids with a checkpoint's tokenizer.json (HF `tokenizers`), and streaming decode."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import CheckpointError


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the tokenizer_config facts we use (bos/eos tokens, the chat
    template). From a HF folder (`from_folder`) or a GGUF file's metadata (`from_gguf`)."""

    def __init__(self, tok: _HFTokenizer, config: dict, source: str):
        self.tok, self.config, self.source = tok, config, source

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found (needed for text prompts; pass token ids instead)")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        config = _json(folder / "tokenizer_config.json") or {}
        # transformers >= 4.43 may write the template beside it; the separate file wins, as there
        if isinstance(t := (_json(folder / "chat_template.json") or {}).get("chat_template"), str):
            config["chat_template"] = t
        if (folder / "chat_template.jinja").is_file():
            config["chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tok, config, str(folder))

    @classmethod
    def from_gguf(cls, field, path: Path) -> "Tokenizer":
        from .gguf_tokenizer import build
        tok, config = build(field, str(path))
        return cls(tok, config, str(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        v = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(v).__name__}")
    return v


class StreamDecoder:
    """Turns token ids arriving one step at a time into text pieces, holding back an incomplete
    UTF-8 character (shown as U+FFFD) until the token that completes it arrives."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece
