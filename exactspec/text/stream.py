"""Text as it streams: `StreamDecoder` turns token ids arriving step by step into text pieces (never
half a UTF-8 character), `StopMatcher` finds stop strings across those pieces."""
from __future__ import annotations

from .tokenizer import Tokenizer


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


class StopCut:
    """Token ids to text, cut at the first stop string. With stop strings the ids go through one at a
    time, as plain decoding delivers them, so the cut (the token that completes a stop string) is a
    function of the ids alone, however many of them a verified draft brought at once. Every count
    an answer reports (its tokens, logprobs, usage) ends at that token."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.dec, self.stop = StreamDecoder(tokenizer), StopMatcher(stops)

    def feed(self, ids: list[int]) -> tuple[str, int, bool]:
        """(the text of `ids` up to a stop, how many of them it took, whether a stop was hit)."""
        if not self.stop.stops:
            return self.stop.feed(self.dec.push(ids))[0], len(ids), False
        out = []
        for i, t in enumerate(ids):
            text, hit = self.stop.feed(self.dec.push([t]))
            out.append(text)
            if hit:
                return "".join(out), i + 1, True
        return "".join(out), len(ids), False

    def finish(self) -> tuple[str, bool]:
        """At the end of the ids: the text held back, and whether it completes a stop string."""
        text, hit = self.stop.feed(self.dec.flush())
        return text + ("" if hit else self.stop.flush()), hit


def tokens_through_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> tuple[int, bool]:
    """How many of a whole answer's ids an answer with these stop strings keeps, and whether a stop hit."""
    cut = StopCut(tokenizer, stops)
    _, used, hit = cut.feed(ids)
    return (used, True) if hit else (len(ids), cut.finish()[1])
