"""Training a drafting head (decode/head.py) on the target's own generations: `exactspec distill --head`.
Needs the `hf` extra (transformers for the layer, tqdm; matplotlib for the plot).

1. record: the target answers chat prompts (greedy, batched); the decode loop hands every committed
   position's final-normed state to a recorder (the same `observe` a head drafter gets), so the
   transcripts and their states come out of one generation, no second forward.
2. the draft vocabulary: the Vd tokens the target emitted most (its EOS ids always in).
3. train (self-distillation, as EAGLE): at position p the head sees (embedding of token p+1, state
   h_p + noise) and is fitted to h_{p+1} (smooth L1) and to the target's distribution over the draft
   vocabulary read off h_{p+1} (cross-entropy).
4. evaluate on held-out transcripts: acceptance by draft position when the head drafts greedily from
   its own guesses (true states up to p, then its own), saved with a plot of the loss.
"""
from __future__ import annotations

import ast
import json
import math
import random
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from . import distill as T
from ..decode.drafters import Drafter
from ..decode.head import FORMAT, META, TENSORS, fingerprint
from ..decode.loop import run_batch
from ..text import chat

GENERAL = [
    "Explain what a hash table is.", "Write a haiku about autumn.", "What is the capital of Japan?",
    "Give three tips for writing clean code.", "Explain recursion to a beginner.", "What is photosynthesis?",
    "Write a short story about a robot learning to paint.", "How do vaccines work?",
    "Summarize the causes of World War I.", "What is the difference between weather and climate?",
    "Explain how a CPU cache works.", "Write an email asking for a day off.", "What are prime numbers?",
    "Describe the water cycle.", "How do I make a cup of tea?", "Explain Big O notation with examples.",
]
EDITS = ["Add type hints to this function and return the whole function:", "Rewrite this function with a "
         "docstring and clearer variable names:", "Explain what this code does, line by line:",
         "Fix any bugs in this code and show the corrected version:", "List the names this function uses, "
         "one per line:", "Translate this Python function to JavaScript:"]


def stdlib_prompts(limit: int, seed: int = 0, edits: bool = True) -> list[str]:
    """Chat prompts from the standard library (every machine has it): a module's purpose, a function to
    write from its docstring, and (edits) a function's source to edit, explain or quote from."""
    out: list[str] = []
    rnd = random.Random(seed)
    for f in T.corpus_files(T.stdlib_folder()):
        if "test" in f.parts or "idlelib" in f.parts:
            continue
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if (doc := ast.get_docstring(tree)) and len(doc.split("\n")[0]) > 20:
            out.append(f"What is the Python module `{f.stem}` for? {doc.splitlines()[0]}")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 20 < len(doc.splitlines()[0]) < 160:
                    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
                    out.append(f"Write a Python function `{node.name}({args})`: {doc.splitlines()[0]}")
                code = (ast.get_source_segment(src, node) or "") if edits else ""
                if 3 <= code.count("\n") <= 25:
                    out.append(f"{rnd.choice(EDITS)}\n\n```python\n{code}\n```")
    rnd.shuffle(out)
    return out[:limit]


class _Recorder(Drafter):
    """Proposes nothing; keeps each slot's states as the loop hands them over."""
    wants_hidden = True

    def begin(self, n_slots: int, capacity: int) -> None:
        self.states: list[list[np.ndarray]] = [[] for _ in range(n_slots)]

    def observe(self, slot: int, start: int, hidden: np.ndarray) -> None:
        have = sum(map(len, self.states[slot]))
        assert start == have, (start, have)  # no drafts: every forward row is committed, in order
        self.states[slot].append(hidden.astype(np.float16))


def _chat(model, prompt: str | list[int]) -> str | list[int]:
    """A text prompt as a user turn of the model's chat template (as served); token ids, or text for
    a model without a template, as they are."""
    if isinstance(prompt, str) and model.tokenizer is not None and chat.template_source(model.tokenizer.config):
        return chat.render(model.tokenizer.config, [{"role": "user", "content": prompt}])
    return prompt


def record(model, prompts: list[str] | list[list[int]], minutes: float, batch: int = 16, max_new: int = 256
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens (T,) int32, states (T - 1, H) float16) per chat: the target's greedy answer to each
    prompt (text: a chat turn; or token ids), for up to `minutes`."""
    from tqdm import tqdm
    out: list[tuple[np.ndarray, np.ndarray]] = []
    t0, n = time.time(), 0
    bar = tqdm(total=len(prompts), desc="record", unit="chat")
    for i in range(0, len(prompts), batch):
        if time.time() - t0 > minutes * 60:
            break
        reqs = [model.request(_chat(model, p), max_new, num_draft_tokens=0) for p in prompts[i:i + batch]]
        rec = _Recorder()
        seqs, _ = run_batch(model.net, reqs, rec)
        for s in seqs:
            st = np.concatenate(rec.states[s.slot])
            toks = np.asarray(s.tokens, np.int32)
            out.append((toks[: len(st) + 1], st))
            n += len(st)
        bar.update(len(reqs))
        bar.set_postfix_str(f"{n} positions, {n / (time.time() - t0):.0f}/s")
    bar.close()
    return out


def draft_vocab(data: list[tuple[np.ndarray, np.ndarray]], size: int, eos: tuple[int, ...], V: int) -> np.ndarray:
    """The `size` tokens the target emitted most (ids sorted), its EOS ids included."""
    counts = np.zeros(V, np.int64)
    for toks, _ in data:
        np.add.at(counts, toks, 1)
    counts[list(eos)] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top).astype(np.int64)


class HeadNet(nn.Module):
    """The head in torch (training): fc, a one-layer Llama over the draft vocabulary whose tied
    embedding is the target's LM head rows of those tokens (frozen)."""

    def __init__(self, cfg, rows: torch.Tensor):
        super().__init__()
        import transformers as tf
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        lc = tf.LlamaConfig(vocab_size=rows.shape[0], hidden_size=H, intermediate_size=cfg.intermediate_size,
                            num_hidden_layers=1, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                            rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=True,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.layer = tf.LlamaForCausalLM(lc)
        self.layer.model.embed_tokens.weight.data.copy_(rows)
        self.layer.model.embed_tokens.weight.requires_grad_(False)

    def forward(self, emb: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) embeddings of tokens p+1 and states h_p -> (guesses of h_{p+1}, their logits (B, T, Vd))."""
        x = self.fc(torch.cat([emb, states], -1))
        h = self.layer.model(inputs_embeds=x).last_hidden_state
        return h, self.layer.lm_head(h)


def _batch(data, idx, seq: int, rng: np.random.Generator, embed: torch.Tensor):
    """Windows of up to seq positions from transcripts idx: (emb, states in, states out, mask)."""
    wins = []
    for i in idx:
        toks, st = data[i]
        n = len(st) - 1  # inputs p = 0 .. len(st) - 2 (their target state p + 1 exists)
        s = int(rng.integers(0, max(1, n - seq + 1)))
        e = min(n, s + seq)
        wins.append((toks[s + 1: e + 1], st[s:e], st[s + 1: e + 1]))
    L = max(len(w[0]) for w in wins)
    H = embed.shape[1]
    emb, h_in, h_out = (torch.zeros(len(wins), L, H) for _ in range(3))
    mask = torch.zeros(len(wins), L)
    for b, (t, a, o) in enumerate(wins):
        emb[b, :len(t)] = embed[torch.from_numpy(t.astype(np.int64))]
        h_in[b, :len(t)] = torch.from_numpy(a.astype(np.float32))
        h_out[b, :len(t)] = torch.from_numpy(o.astype(np.float32))
        mask[b, :len(t)] = 1
    return emb, h_in, h_out, mask


def fit(net: HeadNet, data, embed: torch.Tensor, minutes: float, batch: int = 8, seq: int = 256, lr: float = 1e-3,
        steps: int | None = None,
        noise: float = 0.1, ce_weight: float = 1.0, seed: int = 0) -> dict:
    """Train for `minutes` (or exactly `steps` steps): smooth L1 to the next state + cross-entropy to the
    target's draft-vocabulary
    distribution at it. Returns the loss curve."""
    from tqdm import tqdm
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows = net.layer.model.embed_tokens.weight  # frozen: the target's LM head rows
    budget, t0, step, curve, ema = minutes * 60, time.time(), 0, [], None
    bar = tqdm(total=int(budget), desc="train head", unit="s", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s {postfix}")
    net.train()
    while (time.time() - t0 < budget) if steps is None else step < steps:  # steps: the same head on any machine
        frac = (time.time() - t0) / budget if steps is None else step / steps
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        emb, h_in, h_out, mask = _batch(data, rng.integers(0, len(data), batch), seq, rng, embed)
        h_in = h_in + noise * torch.randn_like(h_in) * h_in.std()
        guess, logits = net(emb, h_in)
        m = mask.unsqueeze(-1)
        reg = (nn.functional.smooth_l1_loss(guess, h_out, reduction="none") * m).sum() / (m.sum() * guess.shape[-1])
        with torch.no_grad():
            p = torch.softmax(h_out @ rows.T, -1)
        ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
        ce = (ce * mask).sum() / mask.sum()
        loss = reg + ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        curve.append((step, time.time() - t0, reg.item(), ce.item()))
        bar.n = int(min(budget, time.time() - t0))
        bar.set_postfix_str(f"step {step} loss {ema:.3f} (reg {curve[-1][2]:.3f} ce {curve[-1][3]:.3f})")
        bar.refresh()
    bar.close()
    net.eval()
    return {"steps": step, "seconds": time.time() - t0, "curve": curve}


@torch.no_grad()
def acceptance(net: HeadNet, data, embed: torch.Tensor, vocab: torch.Tensor, k: int = 6, starts: int = 400,
               seed: int = 1) -> list[float]:
    """Greedy chain drafting on held-out transcripts: from true states up to position p, k tokens from
    the head's own guesses; [i]: the share of starts whose first i + 1 drafts all equal the transcript."""
    rng = np.random.default_rng(seed)
    hits = np.zeros(k)
    done = 0
    for _ in range(starts):
        toks, st = data[int(rng.integers(0, len(data)))]
        if len(st) < k + 8:
            continue
        p = int(rng.integers(4, len(st) - k - 1))  # h_0 .. h_p true; drafts tokens p+2 ..
        emb = embed[torch.from_numpy(toks[1: p + 2].astype(np.int64))]
        states = torch.from_numpy(st[: p + 1].astype(np.float32))
        ok = True
        for i in range(k):
            guess, logits = net(emb[None], states[None])
            t = int(vocab[int(logits[0, -1].argmax())])
            ok = ok and t == int(toks[p + 2 + i])
            if not ok:
                break
            hits[i] += 1
            emb = torch.cat([emb, embed[t][None]])
            states = torch.cat([states, guess[0, -1:]])
        done += 1
    return (hits / max(done, 1)).tolist()


def plot(curve: list, acc: list[float], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the figures are in head.json
        print(f"matplotlib is not installed: no {path.name}")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [c[0] for c in curve]
    for j, name in ((2, "state (smooth L1)"), (3, "token (cross-entropy)")):
        v = np.array([c[j] for c in curve])
        w = max(1, len(v) // 50)
        a.plot(steps[w - 1:], np.convolve(v, np.ones(w) / w, "valid"), label=name)
    a.set_xlabel("step")
    a.set_yscale("log")
    a.set_title("training loss")
    a.legend()
    b.bar(range(1, len(acc) + 1), acc)
    b.set_xlabel("draft position")
    b.set_ylabel("share accepted (all before it too)")
    b.set_title("held-out acceptance, greedy chain")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_head(net: HeadNet, vocab: np.ndarray, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    net.layer.to(torch.bfloat16).save_pretrained(out)
    net.layer.float()
    save_file({"fc.weight": net.fc.weight.detach().to(torch.bfloat16).contiguous(),
               "vocab": torch.from_numpy(vocab).contiguous()}, str(out / TENSORS))
    (out / META).write_text(json.dumps(meta, indent=1))


def distill_head(model, out: Path, prompts: list[str], record_minutes: float = 10.0, train_minutes: float = 15.0,
                 draft_vocab_size: int = 8192, max_new: int = 256, batch: int = 16, data_cache: Path | None = None,
                 name: str = "", init: Path | None = None, lr: float = 1e-3, steps: int | None = None,
                 extra_data: Sequence[Path] = ()) -> dict:
    """Record the target's answers (or read them from `data_cache`, where an earlier run saved them),
    train a head on them and on `extra_data` (other runs' caches; from `init`, a head folder for this
    model, to train one further), save it to `out` (see module doc)."""
    if data_cache is not None and data_cache.is_file():
        data = _load_data(data_cache)
    else:
        data = record(model, prompts, record_minutes, batch, max_new)
        if data_cache is not None:
            np.savez(data_cache, n=len(data), **{f"t{i}": t for i, (t, _) in enumerate(data)},
                     **{f"s{i}": s for i, (_, s) in enumerate(data)})
    for path in extra_data:
        data += _load_data(path)
    cfg = model.net.cfg
    vocab = draft_vocab(data, min(draft_vocab_size, cfg.vocab_size), model.eos_token_ids, cfg.vocab_size)
    if init is not None:
        from safetensors.torch import load_file
        vocab = load_file(str(init / TENSORS))["vocab"].numpy()
    embed = model.net.embed_rows(torch.arange(cfg.vocab_size))  # (V, H): what the drafter looks up
    head_rows = _lm_rows(model.net, vocab)
    n_val = max(1, len(data) // 50)
    train_set, val_set = data[n_val:], data[:n_val]
    net = HeadNet(cfg, head_rows)
    if init is not None:
        from safetensors.torch import load_file
        net.fc.weight.data.copy_(load_file(str(init / TENSORS))["fc.weight"].float())
        layer = {k: v.float() for k, v in load_file(str(init / "model.safetensors")).items() if "embed_tokens" not in k}
        net.layer.load_state_dict(layer, strict=False)
    stats = fit(net, train_set, embed, train_minutes, lr=lr, steps=steps)
    acc = acceptance(net, val_set, embed, torch.from_numpy(vocab))
    positions = int(sum(len(s) for _, s in data))
    covered = float(np.mean(np.isin(np.concatenate([t[1:] for t, _ in data]), vocab)))
    meta = {"format": FORMAT, "target": fingerprint(model.net, model.tokenizer), "target_name": name or str(model.folder),
            "draft_vocab": int(len(vocab)), "draft_vocab_coverage": covered, "transcripts": len(data),
            "positions": positions, "steps": stats["steps"], "train_seconds": stats["seconds"],
            "final_loss": {"state": stats["curve"][-1][2], "token": stats["curve"][-1][3]} if stats["curve"] else None,
            "acceptance_by_position": acc}
    save_head(net, vocab, out, meta)
    plot(stats["curve"], acc, out / "training.png")
    return meta


def _load_data(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.load(path, allow_pickle=False)
    return [(z[f"t{i}"], z[f"s{i}"]) for i in range(int(z["n"]))]


def _lm_rows(net, vocab: np.ndarray) -> torch.Tensor:
    """(Vd, H) float32: the target's LM head rows of the draft vocabulary, as its kernel sees them."""
    return net.lm_head.unpack()[torch.from_numpy(vocab)].contiguous()
