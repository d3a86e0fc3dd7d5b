"""A drafting head on the target's own hidden states (EAGLE-style). Only speed depends on it: the
target verifies every token, so the output is the target's whatever the head proposes.

The head is one decoder layer of the target's shape plus a projection: at position p it takes the
target's final-normed state h_p and the embedding of the token at p + 1, `fc` maps [e, h] (2H) to
H, the layer (its own KV cache over the head's earlier positions) and a final norm give a guess of
h_{p+1}, and the target's LM head, restricted to the draft vocabulary (the tokens the target says
most), reads the next token off it. Drafting then goes on from its own guesses: (guess of h_{p+1},
the drafted token) -> guess of h_{p+2} -> ... The verify forward hands the true states of the
committed positions back (`observe`), so each step starts again from the target's own states at no
extra target forward.

A head folder (`exactspec distill --head`, exactspec/tools/head_train.py):
  config.json, model.safetensors  the layer as a one-layer Llama over the draft vocabulary (its
                                  tied embedding = the target's LM head rows of those tokens)
  head.safetensors                fc.weight (H, 2H); vocab (Vd,) int64, the draft vocabulary's ids
  head.json                       what it was trained for (`fingerprint`) and how
"""
from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import kernels as K
from ..errors import CheckpointError, UnsupportedModelError
from ..kernels.threads import torch_serial
from ..model.transformer import Rows, Transformer, int64s
from ..text.tokenizer import Tokenizer
from .cost import Acceptance, draft_drift, drifts, interleaved, observe_drafting, one_row, seen
from .drafters import Drafter
from .sampling import SamplingParams, pick

FORMAT = "exactspec-head/1"
META, TENSORS = "head.json", "head.safetensors"


def fingerprint(net: Transformer, tokenizer: Tokenizer | None) -> dict:
    """What a head must match: the target's shape and its vocabulary (the sha256 of its tokens in id
    order), the same for a model's GGUF file and its HF folder, at any dtype."""
    c = net.cfg
    fp = {"arch": c.arch, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.n_layers,
          "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads}
    if tokenizer is not None:
        vocab = sorted(tokenizer.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        fp["vocab_sha256"] = hashlib.sha256("\n".join(t for t, _ in vocab).encode()).hexdigest()
    return fp


@dataclass
class Head:
    folder: Path
    net: Transformer  # the layer, over the draft vocabulary
    fc: K.PackedWeight  # (H, 2H)
    vocab: torch.Tensor  # (Vd,) int64: draft index -> the target's token id
    meta: dict

    def __hash__(self) -> int:  # a weak-dict key (its measured cost)
        return id(self)


def load_head(folder: str | Path, target: Transformer, tokenizer: Tokenizer | None, weights: str = "q8_0") -> Head:
    """A head folder, checked against the target it is to draft for (a named error if it was trained
    for another model). `weights`: the layer's as Q8_0 (a draft step costs 0.055 of a SmolLM2 Q4_1
    forward vs 0.083-0.114 in bfloat16; falls back to bfloat16 where a row is not whole blocks of 32),
    "bfloat16" or "float32". Only speed depends on it (and how often drafts are accepted)."""
    with torch_serial():  # loaded where it will not run (kernels/threads.py)
        return _load_head(Path(folder).expanduser(), target, tokenizer, weights)


def _load_head(folder: Path, target: Transformer, tokenizer: Tokenizer | None, weights: str) -> Head:
    from ..model.checkpoint import open_checkpoint
    from safetensors.torch import load_file
    for name in (META, TENSORS, "config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder}: not a drafting head (no {name}; made by `exactspec distill --head`)")
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / META}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / META}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    want, have = meta.get("target", {}), fingerprint(target, tokenizer)
    diff = [k for k in have if k in want and want[k] != have[k]] + [k for k in ("vocab_size", "hidden_size")
                                                                    if k not in want]
    if diff:
        k = diff[0]
        raise CheckpointError(f"{folder}: a head trained for another model ({meta.get('target_name', '?')}): its "
                              f"target's {k} is {want.get(k)!r}, this model's {have.get(k)!r}")
    t = load_file(str(folder / TENSORS))
    H, V = target.cfg.hidden_size, target.cfg.vocab_size
    fc, vocab = t.get("fc.weight"), t.get("vocab")
    if fc is None or tuple(fc.shape) != (H, 2 * H):
        raise CheckpointError(f"{folder / TENSORS}: fc.weight {None if fc is None else tuple(fc.shape)}, expected "
                              f"({H}, {2 * H})")
    if vocab is None or vocab.ndim != 1 or vocab.dtype != torch.int64 or not len(vocab) or \
            int(vocab.min()) < 0 or int(vocab.max()) >= V:
        raise CheckpointError(f"{folder / TENSORS}: vocab must be (Vd,) int64 token ids below {V}")
    try:
        net = open_checkpoint(folder, "bfloat16" if weights == "q8_0" else weights, target.max_context,
                              quantize="q8_0" if weights == "q8_0" else None).net
    except UnsupportedModelError:  # rows that are not whole blocks of 32 (a tiny test model)
        if weights != "q8_0":
            raise
        net = open_checkpoint(folder, "bfloat16", target.max_context).net
    if net.cfg.vocab_size != len(vocab) or net.cfg.hidden_size != H:
        raise CheckpointError(f"{folder}: the layer's vocabulary ({net.cfg.vocab_size}) or width "
                              f"({net.cfg.hidden_size}) does not match vocab ({len(vocab)}) and the target ({H})")
    return Head(folder, net, K.pack_weight(fc.float() if weights == "float32" else fc.to(torch.bfloat16)),
                vocab.contiguous(), meta)


def shipped_head(target: Transformer, tokenizer: Tokenizer | None) -> Path | None:
    """The head shipped in the package (exactspec/assets/*/head.json) trained for this target, if any."""
    have = fingerprint(target, tokenizer)
    for meta in sorted((Path(__file__).resolve().parent.parent / "assets").glob(f"*/{META}")):
        try:
            want = json.loads(meta.read_text()).get("target", {})
        except (OSError, ValueError):
            continue
        if want == have:
            return meta.parent
    return None


_COST: "weakref.WeakKeyDictionary[Head, tuple]" = weakref.WeakKeyDictionary()  # (a step, a further row) / a forward
_SECONDS: "weakref.WeakKeyDictionary[Head, tuple]" = weakref.WeakKeyDictionary()  # the same in seconds


class HeadDrafter(Drafter):
    """Drafts with a Head. Per slot it keeps the target's states of the sequence's committed positions
    (from `observe`) and its own KV cache: entry j is (state at start + j, token at start + j + 1), where
    start is the first position whose state it saw (a prompt that began in shared prefix-cache blocks
    starts later). Entries past the committed ones came from its own guesses and are rewritten."""
    wants_hidden = True
    ALTERNATIVES = 3  # runners-up kept for tree verification (greedy only)

    def __init__(self, head: Head, target: Transformer):
        self.head, self.target = head, target
        self.H = target.cfg.hidden_size
        self.forward_passes = self.rows_fed = 0
        self.first_row: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> its last draft's first logits row and pick

    @property
    def seen(self) -> Acceptance:
        return seen(self.head.net)

    def alternatives(self, slot: int) -> list[int]:
        """Ranked only when asked (tree verification on): the head's next choices after its pick."""
        if slot not in self.first_row:
            return []
        row, t = self.first_row[slot]
        top = self.head.vocab[torch.topk(row, min(self.ALTERNATIVES + 1, len(row))).indices].tolist()
        return [a for a in top if a != t][: self.ALTERNATIVES]

    def begin(self, n_slots: int, capacity: int) -> None:
        self.cache = self.head.net.new_cache(n_slots, capacity)
        self.states = [np.empty((0, self.H), np.float32) for _ in range(n_slots)]
        self.start = [0] * n_slots  # target position of entry 0
        self.known = [0] * n_slots  # states held: positions start .. start + known - 1
        self.fed = [0] * n_slots  # head cache entries computed from true states

    def release(self, slot: int) -> None:
        self.first_row.pop(slot, None)
        self.known[slot] = self.fed[slot] = self.start[slot] = 0
        self.states[slot] = np.empty((0, self.H), np.float32)
        self.cache.release(slot)

    def observe(self, slot: int, start: int, hidden: np.ndarray) -> None:
        if not len(hidden):
            return
        j = start - self.start[slot]
        if self.known[slot] == 0 or not 0 <= j <= self.known[slot]:  # the first states, or a gap: start over
            self.start[slot], self.known[slot], self.fed[slot], j = start, 0, 0, 0
        st = self.states[slot]
        end = j + len(hidden)
        if end > len(st):
            grown = np.empty((max(end, 2 * len(st), 64), self.H), np.float32)
            grown[:len(st)] = st
            st = self.states[slot] = grown
        st[j:end] = hidden
        self.known[slot] = end
        self.fed[slot] = min(self.fed[slot], j)

    def _inputs(self, tokens: list[int], states: np.ndarray) -> np.ndarray:
        """fc([embedding of each token, its state]) -> (R, H): the layer's input rows."""
        e = self.target.embed_rows(int64s(tokens)).numpy()
        return K.linear_np(np.ascontiguousarray(np.concatenate([e, states], 1)), self.head.fc)

    def _step(self, rows: Rows, x: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The layer over rows: (logits over the draft vocabulary, the final-normed states of the
        rows whose logits are asked)."""
        hidden = np.empty((len(rows.tok), self.H), np.float32)
        logits = rows.forward(self.head.net, self.cache, x_in=x, hidden=hidden)
        self.forward_passes += 1
        self.rows_fed += len(rows.tok)
        return logits, hidden[rows.out]

    def _pick(self, logits: torch.Tensor, p: SamplingParams, hist: list[int]) -> int:
        """The target's sampling rule on the draft vocabulary (-inf elsewhere): with the same seed the
        same Gumbel-coupled choice the target makes when its distribution is close."""
        if p.greedy and p.repetition_penalty == 1.0:
            return int(self.head.vocab[int(np.argmax(logits.numpy()))])
        full = torch.full((self.target.cfg.vocab_size,), float("-inf"))
        full[self.head.vocab] = logits
        return pick(full, p, len(hist), hist)

    def propose(self, slots: list[int], seqs: list[list[int]], ks: list[int],
                params: list[SamplingParams]) -> list[list[int]]:
        t, before, fed = time.perf_counter(), self.forward_passes, self.rows_fed
        out = self._propose(slots, seqs, ks, params)
        observe_drafting(self.head.net, time.perf_counter() - t, self.forward_passes - before,  # (cost_per_token)
                         self.rows_fed - fed, _SECONDS.get(self.head))
        return out

    def _propose(self, slots: list[int], seqs: list[list[int]], ks: list[int],
                 params: list[SamplingParams]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        rows, toks, feed, live, at = Rows(), [], [], [], {}
        cap = self.cache.capacity
        for s in slots:
            self.first_row.pop(s, None)
        for i, (s, seq, k) in enumerate(zip(slots, seqs, ks)):
            need = len(seq) - 1 - self.start[s]  # entries 0 .. need-1 from true states; the last drafts token 1
            k = min(k, cap - need)
            if k <= 0 or need <= 0 or self.known[s] < need:
                continue
            j0 = min(self.fed[s], need - 1)  # at least the last entry, whose output drafts token 1 (the same
            # sequence proposed for twice without a verify between: the loop's retry of a failed step)
            toks += seq[self.start[s] + j0 + 1: self.start[s] + need + 1]
            rows.add(s, [0] * (need - j0), j0)  # the layer starts from x_in: its rows' token ids are unread
            feed.append(self.states[s][j0:need])
            self.fed[s] = need
            live.append(i)
            at[i] = (need, k)
        if not live:
            return out
        x = self._inputs(toks, np.concatenate(feed))
        first = True
        while live:
            logits, guess = self._step(rows, x)
            rows, toks, states, nxt = Rows(), [], [], []
            for r, i in enumerate(live):
                t = self._pick(logits[r], params[i], seqs[i] + out[i])
                if first and params[i].greedy and params[i].repetition_penalty == 1.0:  # for alternatives()
                    self.first_row[slots[i]] = (logits[r], t)
                out[i].append(t)
                need, k = at[i]
                if len(out[i]) < k:
                    rows.add(slots[i], [0], need + len(out[i]) - 1)
                    toks.append(t)
                    states.append(guess[r])
                    nxt.append(i)
            live, first = nxt, False
            if live:
                x = self._inputs(toks, np.stack(states))
        return out

    def cost_per_token(self, target: Transformer) -> float:
        """One draft step of one row (fc, the layer, the restricted head) over a target forward of one row."""
        return self._costs(target)[0]

    def catch_up(self, target: Transformer) -> float:
        """A further row of its first forward (a state it catches up on) over a target forward of one row."""
        return self._costs(target)[1]

    def _costs(self, target: Transformer) -> tuple[float, float]:
        if self.head not in _COST:
            probe = HeadDrafter(self.head, target)  # its own cache: this drafter's slots stay as they are
            probe.begin(1, 64)
            probe.observe(0, 0, np.zeros((40, self.H), np.float32))
            probe.propose([0], [[1] * 41], [1], [SamplingParams()])  # the 39 entries before the timed one

            def step(fed: int) -> Callable[[], None]:  # one draft token after 40 - fed states to feed
                def run() -> None:
                    probe.fed[0] = fed
                    probe.propose([0], [[1] * 41], [1], [SamplingParams()])
                return run
            one, many, row = interleaved([step(39), step(7), one_row(target)])  # side by side: a slow spell hits all
            _SECONDS[self.head] = (one, max(many - one, 0.0) / 32)
            _COST[self.head] = (one / row, _SECONDS[self.head][1] / row)
        # times its drift in use, over a one-row forward as the loop runs it
        f = draft_drift(self.head.net).factor(0) / drifts(target).factor(0)
        return _COST[self.head][0] * f, _COST[self.head][1] * f
