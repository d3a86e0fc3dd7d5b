"""Text <-> token ids with a checkpoint's tokenizer.json (HF `tokenizers`) or a GGUF file's vocabulary."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import CheckpointError
from ..jsonfile import read_json


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
    return read_json(path) if path.is_file() else None
