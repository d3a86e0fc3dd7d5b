"""Text <-> token ids with a checkpoint's tokenizer.json (HF `tokenizers`), and streaming decode."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import CheckpointError


class Tokenizer:
    def __init__(self, folder: Path):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found (needed for text prompts; pass token ids instead)")
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict = {}
        if cfg_path.is_file():
            try:
                self.config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


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
