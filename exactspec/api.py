"""Public API: `load(path)` -> Model with `logits`, `generate`, `generate_batch`."""
from __future__ import annotations

import json
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from .config import ModelConfig, load_config
from .decode import DraftLength, Stats, decode
from .drafters import DraftModelDrafter, Drafter, LookupDrafter
from .errors import CheckpointError, InvalidArgumentError, UnsupportedModelError
from .gguf_file import GGUFFile
from .model import DTYPES, Transformer, load_transformer
from .sampling import SamplingParams
from .sources import is_gguf, resolve
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str
    finish_reason: str  # "stop" (EOS) | "length"
    stats: Stats


class Model:
    def __init__(self, folder: Path, cfg: ModelConfig, net: Transformer, tokenizer: Tokenizer | None,
                 eos: tuple[int, ...]):
        self.folder, self.cfg, self.net, self.tokenizer, self.eos_token_ids = folder, cfg, net, tokenizer, eos
        self._same_vocab: weakref.WeakSet = weakref.WeakSet()  # draft Models whose tokenizer matched ours

    def __repr__(self) -> str:
        return f"Model({str(self.folder)!r}, arch={self.cfg.arch}, dtype={self.net.dtype})"

    # -- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise CheckpointError(f"{self.folder}: no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF), so "
                                      "prompts must be lists of token ids")
            return self.tokenizer.encode(prompt)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidArgumentError("prompt must be a str or a list of int token ids") from None
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # -- forward ------------------------------------------------------------------------------
    def logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """(len(token_ids), vocab) float32 logits from one forward over the whole sequence."""
        ids = self.encode(list(token_ids))
        if not ids:
            return torch.empty(0, self.cfg.vocab_size)
        if len(ids) > self.net.max_context:
            raise InvalidArgumentError(f"{len(ids)} tokens exceed max_context={self.net.max_context}")
        cache = self.net.new_cache(1, len(ids))
        n = len(ids)
        return self.net.forward(torch.tensor(ids), torch.zeros(n, dtype=torch.long), torch.arange(n), cache)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str | Seq[int], max_new_tokens: int = 128, **kw) -> GenerationResult:
        on_text = kw.pop("on_text", None)
        cb = (lambda i, t: on_text(t)) if on_text is not None else None
        return self.generate_batch([prompt], max_new_tokens=max_new_tokens, on_text=cb, **kw)[0]

    def generate_batch(self, prompts: Seq[str | Seq[int]], max_new_tokens: int = 128, *, ignore_eos: bool = False,
                       draft: "None | str | Model" = None, num_draft_tokens: int | str = 4,
                       draft_confidence: float = 0.0, lookup_max_ngram: int = 3,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       repetition_penalty: float = 1.0, seed: int | None | Seq[int | None] = 0,
                       on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Decode a batch of prompts. `draft`: None (plain), "lookup" (prompt lookup) or another
        Model sharing the tokenizer. The token ids never depend on draft, num_draft_tokens or
        the batch: only on the prompt, the sampling parameters and the seed."""
        if isinstance(prompts, (str, bytes)):
            raise InvalidArgumentError("generate_batch takes a list of prompts; use generate for one")
        ids = [self.encode(p) for p in prompts]
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(ids)
        if len(seeds) != len(ids):
            raise InvalidArgumentError(f"seed: {len(seeds)} seeds for {len(ids)} prompts")
        # seed=None: greedy ignores it; sampling draws a fresh one, reported in stats.seed for replay
        seeds = [(0 if not temperature else secrets.randbits(63)) if s is None else s for s in seeds]
        params = [SamplingParams(float(temperature), top_k, float(top_p), float(min_p), float(repetition_penalty), s)
                  for s in seeds]
        drafter = self.make_drafter(draft, draft_confidence, lookup_max_ngram)
        dl = DraftLength(num_draft_tokens if drafter is not None else 0)
        streams = [StreamDecoder(self.tokenizer) for _ in ids] if on_text and self.tokenizer else None

        def stream(i: int, new: list[int]) -> None:
            if piece := streams[i].push(new):
                on_text(i, piece)
        eos = set() if ignore_eos else set(self.eos_token_ids)
        seqs = decode(self.net, ids, params, max_new_tokens, eos, drafter, dl,
                         stream if streams is not None else None)
        if streams is not None:
            for i, st in enumerate(streams):
                if piece := st.flush():
                    on_text(i, piece)
        if temperature:
            for s, sd in zip(seqs, seeds):
                s.stats.seed = sd
        return [GenerationResult(s.generated, self.decode(s.generated), s.finish_reason, s.stats) for s in seqs]

    def make_drafter(self, draft, confidence: float = 0.0, max_ngram: int = 3) -> Drafter | None:
        if draft is None:
            return None
        if isinstance(draft, str):
            if draft == "lookup":
                return LookupDrafter(max_ngram=max_ngram)
            raise InvalidArgumentError(f"draft={draft!r}: unknown drafter (use 'lookup', a loaded Model, or None)")
        if isinstance(draft, Model):
            if draft.cfg.vocab_size != self.cfg.vocab_size:
                raise InvalidArgumentError(
                    f"draft model {draft.folder}: vocabulary size {draft.cfg.vocab_size} differs from the "
                    f"target's {self.cfg.vocab_size}; draft and target must share a tokenizer")
            if self.tokenizer is not None and draft.tokenizer is not None and draft not in self._same_vocab:
                # get_vocab() costs ~1 ms for a 4k vocabulary: compare once per draft model
                if self.tokenizer.tok.get_vocab() != draft.tokenizer.tok.get_vocab():
                    raise InvalidArgumentError(f"draft model {draft.folder}: tokenizer vocabulary differs from the "
                                               "target's")
                self._same_vocab.add(draft)
            return DraftModelDrafter(draft.net, confidence)
        raise InvalidArgumentError(f"draft={draft!r}: expected None, 'lookup' or an exactspec Model")


def _eos_ids(folder: Path, cfg: ModelConfig) -> tuple[int, ...]:
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{gen}: not valid JSON ({e})") from None
        v = g.get("eos_token_id")
        if v is not None:
            return (v,) if isinstance(v, int) else tuple(v)
    return cfg.eos_token_ids


def load(path: str | Path, dtype: str = "float32", max_context: int | None = None) -> Model:
    """Load a model: a HF checkpoint folder, a .gguf file, or a Hugging Face Hub id (`org/name`,
    resolved through the local hub cache; HF_HUB_OFFLINE=1 keeps it offline). dtype: weights kept
    as "float32" or "bfloat16" (math in float32). max_context: longest sequence (prompt + new
    tokens) served; default min(config, 8192)."""
    folder = resolve(path)
    gguf = is_gguf(folder)
    if not folder.is_dir() and not gguf:
        raise CheckpointError(f"{folder}: not a directory or a .gguf file (expected a Hugging Face checkpoint "
                              "folder or a GGUF file)")
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype={dtype!r} is not supported (float32, bfloat16)")
    if gguf:
        store = GGUFFile(folder)
        cfg = store.cfg
    else:
        cfg = load_config(folder)
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, 8192)
    if not isinstance(max_context, int) or max_context < 2:
        raise InvalidArgumentError(f"max_context={max_context!r}: must be an integer >= 2")
    if gguf:  # weights dequantized to `dtype`
        return Model(folder, cfg, Transformer(cfg, store, dtype, max_context), store.tokenizer(), cfg.eos_token_ids)
    net = load_transformer(folder, cfg, dtype, max_context)
    tok = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return Model(folder, cfg, net, tok, _eos_ids(folder, cfg))
