"""Public API: `load(path)` -> Model with `logits`, `generate`, `generate_batch`.

Opening the checkpoint is model/checkpoint.py's; text is encoded here; every generation input is
then checked once, by decode.request.make_request, against the target (and the drafter by
make_drafter), before anything runs.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .decode.drafters import DraftModelDrafter, Drafter, LookupDrafter, NgramPool, PoolDrafter
from .decode.mix import MixDrafter
from .decode.constraint import Grammar, Vocab, make_grammar
from .decode.head import Head, HeadDrafter, load_head, shipped_head
from .decode.loop import run_batch
from .decode.stats import BatchStats, Stats
from .decode.request import Limits, Request, check_prompt, make_request
from .decode.sampling import SamplingParams, TokenLogprob, token_logprobs
from . import receipt
from .errors import CheckpointError, ConstraintError, GenerationError, InvalidRequest, UnsupportedModelError
from .model.cache import KV_DTYPES
from .model.checkpoint import open_checkpoint
from .model.config import ModelConfig
from .model.transformer import Rows, Transformer
from .text.stream import StreamDecoder
from .text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str
    finish_reason: str  # "stop" (EOS) | "length"
    stats: Stats  # this sequence's figures
    batch: BatchStats  # the whole call's figures (one object shared by the results of a generate_batch)
    logprobs: list[TokenLogprob] | None = None  # per new token, when asked (logprobs=k)
    request: Request | None = None  # the validated request it answers (its seed resolved)
    model: "Model | None" = dataclasses.field(default=None, repr=False)

    def receipt(self) -> dict:
        """A receipt for this answer (exactspec/receipt.py): the model's identity, the numerics version,
        the request and the output's token ids; `exactspec verify` replays it by plain decoding."""
        if self.model is None or self.request is None:
            raise InvalidRequest("this result carries no request to write a receipt for", "receipt")
        return receipt.make(self.model, self.request, [(self.request.params.seed, self.token_ids, self.finish_reason)])


class Model:
    def __init__(self, folder: Path, cfg: ModelConfig, net: Transformer, tokenizer: Tokenizer | None,
                 eos: tuple[int, ...]):
        self.folder, self.cfg, self.net, self.tokenizer, self.eos_token_ids = folder, cfg, net, tokenizer, eos
        self._same_vocab: weakref.WeakSet = weakref.WeakSet()  # draft Models whose tokenizer matched ours
        self._pool: NgramPool | None = None  # draft="pool": the n-grams of this model's earlier sequences
        self._heads: dict[str | None, Head] = {}  # draft="head[:PATH]": loaded once
        self.load_args: dict = {}  # how `load` was called (dtype, quantize, activations, kv_dtype): receipts
        self._vocab: Vocab | None = None  # the tokenizer as the grammar matcher reads it: built once

    def __getstate__(self) -> dict:  # Ray's object store (exactspec.serve.ray); a WeakSet does not pickle
        s = dict(self.__dict__)
        s["_same_vocab"] = None
        s["_vocab"] = None  # rebuilt where it is used
        return s

    def __setstate__(self, s: dict) -> None:
        self.__dict__.update(s)
        self._same_vocab = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"Model({str(self.folder)!r}, arch={self.cfg.arch}, dtype={self.net.dtype})"

    # -- text -----------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int] | Sequence[int]:
        """Text through the tokenizer; token ids pass as they are (checked by the request)."""
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise CheckpointError(f"{self.folder}: no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF), so "
                                  "prompts must be lists of token ids")
        return self.tokenizer.encode(prompt)

    def encode_text(self, text: str) -> list[int]:
        """Text as it continues a sequence: no special tokens (BOS) added."""
        if self.tokenizer is None:
            self.encode(text)  # the named error
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def constraint(self, kind: str, value, name: str | None = None) -> Grammar:
        """A validated constraint for this model's tokenizer (decode/constraint.py): kind "json_schema" (a
        dict, JSON text or a pydantic model class), "grammar" (Lark, or llama.cpp's GBNF), "regex" or
        "choice" (a list of strings). Bad input: InvalidRequest naming `name` (default: the kind)."""
        if self.tokenizer is None:
            self.encode("")  # the named error: no tokenizer
        if self._vocab is None:
            self._vocab = Vocab(self.tokenizer.tok.to_str(), self.cfg.vocab_size, self.eos_token_ids)
        return make_grammar(self._vocab, kind, value, name)

    # -- forward --------------------------------------------------------------------------------
    def logits(self, token_ids: str | Sequence[int]) -> torch.Tensor:
        """(len(token_ids), vocab) float32 logits from one forward over the whole sequence."""
        ids = self.encode(token_ids)
        if hasattr(ids, "__len__") and len(ids) == 0:
            return torch.empty(0, self.cfg.vocab_size)  # (0, V)
        ids = check_prompt(ids, self.net.limits, "token_ids")
        rows = Rows()
        rows.add(0, ids, 0, logits_from=0)
        return rows.forward(self.net, self.net.new_cache(1, len(ids)))

    def score(self, prompt: str | Sequence[int], continuation: str | Sequence[int], top: int = 0
              ) -> list[TokenLogprob]:
        """Teacher-forced logprobs of `continuation` after `prompt`, one forward: the same floats
        generation reports for those tokens (any drafter, batch, cache or thread count). To score a
        prompt itself: score(prompt[:1], prompt[1:])."""
        return self.score_batch([(prompt, continuation)], top)[0]

    def _scored(self, prompt: str | Sequence[int], continuation: str | Sequence[int]) -> tuple[list[int], int]:
        """A scored pair as (prompt + continuation token ids, checked against the limits; the prompt's length)."""
        p = list(self.encode(prompt))
        c = list(self.encode(continuation) if not isinstance(continuation, str) or not continuation
                 else self.encode_text(continuation))
        if not p:
            raise InvalidRequest("prompt is empty: the first token has no logprob", "prompt")
        return check_prompt(p + c, self.net.limits, "prompt + continuation"), len(p)

    def score_steps(self, prompt: str | Sequence[int], continuation: str | Sequence[int], top: int = 0,
                    chunk: int = 64) -> Iterator[list[TokenLogprob]]:
        """score() in forwards of at most `chunk` rows, one list of TokenLogprobs per forward, so a
        server can run other requests' steps between them (a long echo costs others one chunk's wait).
        The same floats as score(): a position's logits are a function of its prefix alone."""
        ids, n = self._scored(prompt, continuation)
        if n == len(ids):
            return
        cache = self.net.new_cache(1, len(ids))
        first = n - 1  # the row that predicts the continuation's first token
        for s in range(0, len(ids) - 1, chunk):
            e = min(s + chunk, len(ids) - 1)
            rows = Rows()
            rows.add(0, ids[s:e], s, logits_from=max(0, first - s) if e > first else None)
            logits = rows.forward(self.net, cache)
            if e > first:  # the rows that predict continuation tokens (before them: keys only)
                yield token_logprobs(logits, ids[max(s, first) + 1:e + 1], top)

    def score_batch(self, pairs: Sequence[tuple], top: int = 0) -> list[list[TokenLogprob]]:
        """score() of many (prompt, continuation) pairs, all in one forward."""
        rows, seqs = Rows(), []
        for i, (p, c) in enumerate(pairs):
            ids, n = self._scored(p, c)
            if n < len(ids):  # the rows that predict the continuation: positions n-1 .. len(ids)-2
                rows.add(i, ids[:-1], 0, logits_from=n - 1)
            seqs.append((ids, n))
        if not rows.out:
            return [[] for _ in seqs]
        logits = rows.forward(self.net, self.net.new_cache(len(seqs), max(len(ids) for ids, _ in seqs)))
        out, r = [], 0
        for ids, n in seqs:
            out.append(token_logprobs(logits[r: r + len(ids) - n], ids[n:], top))
            r += len(ids) - n
        return out

    # -- generation -----------------------------------------------------------------------------
    def request(self, prompt: str | Sequence[int], max_new_tokens: int | None = 128, *, ignore_eos: bool = False,
                name: str = "prompt", limits: Limits | None = None, **sampling) -> Request:
        """A validated Request for this model (text encoded, its EOS ids unless ignore_eos), checked
        against `limits` (default: the model's own). `sampling`: make_request's arguments (params, or
        temperature, top_k, ... seed; stop, num_draft_tokens, logprobs, logprobs_mode, cache_scope,
        prediction: text, encoded without special tokens, or token ids)."""
        eos = () if ignore_eos else self.eos_token_ids
        if isinstance(sampling.get("prediction"), str):
            sampling["prediction"] = self.encode_text(sampling["prediction"])
        return make_request(limits or self.net.limits, self.encode(prompt), max_new_tokens, eos=eos, name=name,
                            **sampling)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int | None = 128, **kw) -> GenerationResult:
        """Decode one prompt (text, or token ids): generate_batch([prompt], ...)[0], with `on_text(piece)`
        called as text streams. Every keyword of generate_batch applies (draft, num_draft_tokens,
        temperature, seed, logprobs, prediction, ...)."""
        on_text = kw.pop("on_text", None)
        cb = (lambda i, t: on_text(t)) if on_text is not None else None
        return self.generate_batch([prompt], max_new_tokens=max_new_tokens, on_text=cb, **kw)[0]

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = 128, *,
                       ignore_eos: bool = False, draft: "None | str | Model" = None,
                       num_draft_tokens: int | str = "auto", draft_confidence: float = 0.0, lookup_max_ngram: int = 3,
                       draft_branches: int = 1,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       repetition_penalty: float = 1.0, seed: int | None | Sequence[int | None] = 0,
                       logprobs: int | None = None, logprobs_mode: str = "raw",
                       prediction: "None | str | Sequence[int] | Sequence[None | str | Sequence[int]]" = None,
                       json_schema=None, grammar: "None | str | Sequence[str | None]" = None,
                       regex: "None | str | Sequence[str | None]" = None,
                       choice: "None | Sequence[str] | Sequence[Sequence[str] | None]" = None,
                       on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Decode a batch of prompts (each text or token ids), one result each, in order. The token
        ids never depend on the drafter, the draft length, the batch or the thread count: only on the
        prompt, the sampling parameters and the seed.

        max_new_tokens: per prompt (None: up to the context; prompt + max_new_tokens must fit it).
        ignore_eos: go on past the model's EOS ids.
        draft: None (plain decoding), "lookup" (prompt lookup), "pool" (prompt lookup, then the n-grams
            of the sequences this Model decoded before), "head" / "head:PATH" (a head on this model's
            hidden states, decode/head.py), one of lookup/pool joined to a head by "+", or another Model
            sharing the tokenizer.
        num_draft_tokens: k >= 0, "dynamic" or "auto" (by measured cost; the rules: decode/policy.py).
        draft_confidence: a draft model stops drafting below this probability.
        lookup_max_ngram: the longest n-gram prompt lookup matches.
        draft_branches: > 1: tree verification, up to draft_branches - 1 runners-up of a head's first
            draft token verified beside it where the measured costs say it pays.
        temperature, top_k, top_p, min_p, repetition_penalty: sampling (temperature 0: greedy).
        seed: one, or one per prompt; None: greedy ignores it, sampling draws a fresh one, reported in
            stats.seed so the run can be replayed.
        logprobs: per new token its raw log-probability and this many alternatives (<= 20);
            logprobs_mode "processed": after the sampling filters.
        prediction: the expected output (OpenAI's Predicted Outputs: a file the answer edits), text or
            token ids, one for all prompts or a list with one per prompt; proposed as drafts, so it
            changes the speed only (cut where longer than the context).
        json_schema, grammar, regex, choice: constrained output (at most one of them; decode/constraint.py),
            one for all prompts or a list with one per prompt (None: free). json_schema: a dict, JSON text or
            a pydantic model class; grammar: Lark text or llama.cpp's GBNF; regex: the whole answer matches
            it; choice: the answer is one of these strings. The answer ends where the constraint is
            complete (finish_reason "stop"); with num_draft_tokens other than 0 the text it forces is
            verified as drafts (the tokens stay plain constrained decoding's).
        on_text: on_text(prompt index, text piece) as text streams.

        Bad input raises InvalidRequest naming the argument. If decoding fails inside (not the caller's
        input), raises GenerationError (its `.results` hold every sequence's result, the others complete)."""
        if isinstance(prompts, (str, bytes)):
            raise InvalidRequest("generate_batch takes a list of prompts; use generate for one", "prompts")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise InvalidRequest(f"seed: {len(seeds)} seeds for {len(prompts)} prompts", "seed")
        one_each = isinstance(prediction, (list, tuple)) and len(prediction) > 0 and \
            (prediction[0] is None or isinstance(prediction[0], (str, list, tuple, np.ndarray)))
        preds = list(prediction) if one_each else [prediction] * len(prompts)  # one per prompt, or one for all
        if len(preds) != len(prompts):
            raise InvalidRequest(f"prediction: {len(preds)} predictions for {len(prompts)} prompts", "prediction")
        grammars = self._constraints(len(prompts), json_schema=json_schema, grammar=grammar, regex=regex,
                                     choice=choice)
        drafter = self.make_drafter(draft, draft_confidence, lookup_max_ngram)
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed=None)
        reqs = [self.request(p, max_new_tokens, params=dataclasses.replace(params, seed=sd), ignore_eos=ignore_eos,
                             num_draft_tokens=num_draft_tokens if drafter is not None or g is not None else 0,
                             logprobs=logprobs, logprobs_mode=logprobs_mode,
                             name="prompt" if len(prompts) == 1 else f"prompt {i}",
                             prediction=pr if pr is not None else (), constraint=g)
                for i, (p, sd, pr, g) in enumerate(zip(prompts, seeds, preds, grammars))]
        streams = [StreamDecoder(self.tokenizer) for _ in reqs] if on_text and self.tokenizer else None

        def stream(i: int, new: list[int]) -> None:
            if piece := streams[i].push(new):
                on_text(i, piece)
        seqs, batch = run_batch(self.net, reqs, drafter, stream if streams is not None else None, draft_branches)
        if streams is not None:
            for i, st in enumerate(streams):
                if piece := st.flush():
                    on_text(i, piece)
        results = [GenerationResult(s.generated, self.decode(s.generated), s.finish_reason, s.stats, batch,
                                    s.logprobs if logprobs is not None else None, r, self) for s, r in zip(seqs, reqs)]
        failed = [i for i, s in enumerate(seqs) if s.finish_reason == "error"]
        if failed:  # never a silently short answer: raise, the other sequences' results attached
            i, s = failed[0], seqs[failed[0]]
            where = "prompt" if len(seqs) == 1 else f"prompt {i}"
            where += f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            msg = f"{where}: decoding failed after {len(s.generated)} tokens ({type(s.error).__name__}: {s.error})"
            err = ConstraintError(msg, s.error.field) if isinstance(s.error, ConstraintError) else GenerationError(msg)
            err.results = results  # every sequence's result; finish_reason "error" for the failed ones
            raise err from s.error
        return results

    def _constraints(self, n: int, **given) -> list[Grammar | None]:
        """One constraint (or None) per prompt from generate_batch's json_schema / grammar / regex / choice."""
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise InvalidRequest(f"{' and '.join(given)}: give at most one constraint", next(iter(given)))
        if not given:
            return [None] * n
        (kind, v), = given.items()
        # a list with one per prompt: of schemas or strings (never lists themselves), or of choice lists
        each = isinstance(v, (list, tuple)) and (kind != "choice" or any(x is None or isinstance(x, (list, tuple))
                                                                         for x in v))
        vs = list(v) if each else [v] * n
        if len(vs) != n:
            raise InvalidRequest(f"{kind}: {len(vs)} constraints for {n} prompts", kind)
        made: dict[int, Grammar] = {}  # one compile for a constraint shared by all prompts
        for x in vs:
            if x is not None and id(x) not in made:
                made[id(x)] = self.constraint(kind, x)
        return [None if x is None else made[id(x)] for x in vs]

    def head(self, path: str | Path | None = None) -> Head:
        """A drafting head for this model (decode/head.py), loaded once: from `path`, or the one shipped
        in the package for it (SmolLM2-135M-Instruct's). A head trained for another model: a named error."""
        key = str(path) if path is not None else None
        if key not in self._heads:
            if path is None:
                path = shipped_head(self.net, self.tokenizer)
                if path is None:
                    raise InvalidRequest(f"draft='head': no drafting head is shipped for {self.folder.name}; train "
                                         "one (exactspec distill --head) and pass draft='head:PATH'", "draft")
            self._heads[key] = load_head(path, self.net, self.tokenizer)
        return self._heads[key]

    def make_drafter(self, draft: "None | str | Head | Model", confidence: float = 0.0, max_ngram: int = 3) -> Drafter | None:
        """The drafter for `draft`, checked against this target: None, "lookup", "pool", "head" (the
        shipped head for this model), "head:PATH", a Head, or a Model with the same vocabulary (a
        shorter context is fine: it stops drafting at its end)."""
        if draft is None:
            return None
        if isinstance(draft, str) and "+" in draft:  # a lookup beside a model drafter: "head+lookup"
            parts = draft.split("+")
            free = [p for p in parts if p in ("lookup", "pool")]
            model = [p for p in parts if p not in ("lookup", "pool")]
            if len(parts) != 2 or len(free) != 1 or len(model) != 1:
                raise InvalidRequest(f"draft={draft!r}: join one of 'lookup', 'pool' and one model drafter ('head', "
                                     "'head:PATH'), e.g. 'head+lookup'", "draft")
            return MixDrafter(self.make_drafter(free[0], confidence, max_ngram), self.make_drafter(model[0]), self.net)
        if isinstance(draft, str):
            if draft == "lookup":
                return LookupDrafter(max_ngram=max_ngram)
            if draft == "pool":  # prompt lookup, then the n-grams of this model's earlier sequences
                if self._pool is None or self._pool.max_ngram != max_ngram:
                    self._pool = NgramPool(max_ngram)
                return PoolDrafter(self._pool)
            if draft == "head" or draft.startswith("head:"):  # a head on this model's hidden states
                return HeadDrafter(self.head(draft[5:] or None), self.net)
            raise InvalidRequest(f"draft={draft!r}: unknown drafter (use 'lookup', 'pool', 'head', 'head:PATH', a "
                                 "loaded Model, or None)", "draft")
        if isinstance(draft, Head):
            return HeadDrafter(draft, self.net)
        if isinstance(draft, Model):
            if draft.cfg.vocab_size != self.cfg.vocab_size:
                raise InvalidRequest(
                    f"draft model {draft.folder}: vocabulary size {draft.cfg.vocab_size} differs from the "
                    f"target's {self.cfg.vocab_size}; draft and target must share a tokenizer", "draft")
            if self.tokenizer is not None and draft.tokenizer is not None and draft not in self._same_vocab:
                # get_vocab() costs ~1 ms for a 4k vocabulary: compare once per draft model
                if self.tokenizer.tok.get_vocab() != draft.tokenizer.tok.get_vocab():
                    raise InvalidRequest(f"draft model {draft.folder}: tokenizer vocabulary differs from the "
                                         "target's", "draft")
                self._same_vocab.add(draft)
            return DraftModelDrafter(draft.net, confidence)
        raise InvalidRequest(f"draft={draft!r}: expected None, 'lookup' or an exactspec Model", "draft")


def load(path: str | Path, dtype: str = "auto", max_context: int | None = None, quantize: str | None = None,
         activations: str = "int8", kv_dtype: str = "float32") -> Model:
    """Load a model: a HF checkpoint folder, a .gguf file, or a Hugging Face Hub id (`org/name`,
    resolved through the local hub cache; HF_HUB_OFFLINE=1 keeps it offline).

    dtype: "auto" keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K weights quantized (see
    activations) and the rest as float32; "float32" or "bfloat16"
    dequantizes every weight to that (math in float32). quantize="q8_0", "q4_0", "q4_1", "q5_0" or "q5_1": every
    linear weight (and the embedding) quantized to it at load (llama.cpp's rounding, the gguf
    package), the same kernels. activations: what quantized weights multiply: "int8" (each row quantized
    per block of 32 to int8, as llama.cpp does, then integer dot products: exact, so as invariant as the
    float path, and several times fewer operations) or "float32" (the weights dequantized in registers
    into float FMA chains: bitwise the logits of the dequantized model). Float weights ignore it.
    max_context: longest sequence (prompt + new tokens) served; default min(config, 8192).
    kv_dtype: how the KV cache stores keys and values: "float32", or "bfloat16" (half the memory and
    the attention's reads; each entry rounded once when written, so still invariant; the logits
    differ from float32's by that rounding)."""
    if kv_dtype not in KV_DTYPES:
        raise UnsupportedModelError(f"kv_dtype={kv_dtype!r} is not supported ({', '.join(KV_DTYPES)})")
    c = open_checkpoint(path, dtype, max_context, quantize, activations)
    c.net.kv_dtype = kv_dtype
    m = Model(c.folder, c.cfg, c.net, c.tokenizer, c.eos)
    m.load_args = {"dtype": dtype, "quantize": quantize, "activations": activations, "kv_dtype": kv_dtype}
    return m
