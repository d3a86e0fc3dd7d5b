"""Text <-> token ids with a checkpoint's tokenizer.json (HF `tokenizers`), and streaming decode."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .config import read_json
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
    return read_json(path) if path.is_file() else None


class StreamDecoder:
    """Turns token ids arriving one step at a time into text pieces, holding back an incomplete
    UTF-8 character (shown as U+FFFD) until the token that completes it arrives.

    Incremental: each push decodes only the tokens since the last piece, after the tokens of that
    piece (`ids[start:]`), and cuts off what those earlier tokens decode to. Decoding the window
    from a token already shown keeps what depends on the left context (a SentencePiece word's
    leading space, a byte sequence split across tokens) the same as in the whole text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window starts at the first token of the last piece
        self.sent = 0  # ids[start:sent] are already shown

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        return self._piece(final=False)

    def flush(self) -> str:
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        shown = self.tokenizer.decode(self.ids[self.start:self.sent])
        text = self.tokenizer.decode(self.ids[self.start:])
        if (text.endswith("\ufffd") and not final) or len(text) <= len(shown):
            return ""
        self.start, self.sent = self.sent, len(self.ids)
        return text[len(shown):]


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
