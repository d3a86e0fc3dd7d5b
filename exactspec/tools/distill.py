"""Training the demo pair and distilling drafts (needs the `hf` extra: transformers, tqdm).

Offline by construction: the corpus is a folder of text/source files on disk (the demo uses the
running interpreter's own standard library, `Lib/`, which every machine has).

    exactspec distill --target DIR --corpus DIR --out DIR [--minutes 20]
    python scripts/demo_pair.py --out exactspec/assets/            (tokenizer + target + distilled draft)
"""
from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, InvalidRequest

EOS = "<|endoftext|>"


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Sorted source files under folder, skipping installed packages (site-packages)."""
    if not folder.is_dir():
        raise InvalidRequest(f"corpus {folder}: not a directory")
    files = sorted(p for p in folder.rglob("*") if p.suffix in suffixes and p.is_file()
                   and "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise InvalidRequest(f"corpus {folder}: no {'/'.join(suffixes)} files")
    return files


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def is_validation(path: Path) -> bool:
    """A fixed 2% of files, by name hash, held out."""
    return hashlib.sha1(str(path.name).encode()).digest()[0] < 5


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": None, "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2))


def tokenize(texts: list[str], tok, eos_text: str = EOS) -> np.ndarray:
    """All texts, each followed by EOS, as one uint16 array. tok: a tokenizers.Tokenizer."""
    eos = tok.token_to_id(eos_text)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos if eos is not None else 0)
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)


@dataclass
class TrainSpec:
    minutes: float = 30.0
    max_steps: int = 100_000
    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    warmup: int = 100
    distill_weight: float = 1.0  # KL to the teacher's distribution, when a teacher is given
    temperature: float = 1.0
    seed: int = 0


def _batches(data: np.ndarray, spec: TrainSpec, rng: np.random.Generator):
    n = len(data) - spec.seq - 1
    while True:
        starts = rng.integers(0, n, spec.batch)
        x = np.stack([data[s: s + spec.seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def train(model, data: np.ndarray, val: np.ndarray, spec: TrainSpec, teacher=None, desc: str = "train") -> dict:
    """Next-token training (optionally distilled from `teacher(tokens) -> logits`) for spec.minutes."""
    from tqdm import tqdm
    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = spec.minutes * 60
    t0 = time.time()
    model.train()
    bar = tqdm(total=int(budget), desc=desc, unit="s", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s {postfix}")
    step, ema = 0, None
    for x in _batches(data, spec, rng):
        elapsed = time.time() - t0
        if elapsed > budget or step >= spec.max_steps:
            break
        frac = elapsed / budget
        lr = spec.lr * min(1.0, (step + 1) / spec.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        inp, tgt = x[:, :-1], x[:, 1:]
        logits = model(inp).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                tl = teacher(inp).float() / spec.temperature
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits / spec.temperature, -1),
                                            torch.log_softmax(tl, -1), log_target=True, reduction="batchmean")
            loss = loss + spec.distill_weight * kl / spec.seq
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.n = int(min(budget, time.time() - t0))
        bar.set_postfix_str(f"step {step} loss {ema:.3f} tok/s {step * spec.batch * spec.seq / (time.time() - t0):.0f}")
        bar.refresh()
    bar.close()
    model.eval()
    return {"steps": step, "tokens": step * spec.batch * spec.seq, "train_loss": ema,
            "val_loss": evaluate(model, val, spec), "seconds": time.time() - t0}


@torch.no_grad()
def evaluate(model, val: np.ndarray, spec: TrainSpec, batches: int = 8) -> float:
    rng = np.random.default_rng(123)
    it = _batches(val, TrainSpec(batch=8, seq=spec.seq), rng)
    losses = []
    for _ in range(batches):
        x = next(it)
        logits = model(x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        x[:, 1:].reshape(-1)).item())
    return float(np.mean(losses))


def llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, eos_id: int, ctx: int = 2048):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=ctx,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
                         rms_norm_eps=1e-5)
    return tf.LlamaForCausalLM(cfg)


def save(model, out: Path, tokenizer, eos_id: int, meta: dict) -> None:
    """An HF folder: bf16 safetensors, config, and the target's tokenizer (an exactspec Tokenizer,
    saved as tokenizer.json + tokenizer_config.json, whatever it was loaded from)."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    model.float()
    tokenizer.tok.save(str(out / "tokenizer.json"))
    cfg = {k: v for k, v in tokenizer.config.items() if isinstance(v, (str, bool, int, float, type(None)))}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "do_sample": False}, indent=2))
    (out / "training.json").write_text(json.dumps(meta, indent=2))


def exactspec_teacher(model):
    """teacher(tokens (B, T)) -> (B, T, vocab) float32 logits from an exactspec Model (our kernels,
    bf16 weights: ~5x transformers' float32 forward on 2 cores)."""
    def logits(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([model.logits(row.tolist()) for row in x])
    return logits


def distill(target: str | Path, corpus: Path | list[Path], out: Path, minutes: float = 20.0, hidden: int = 192,
            layers: int = 2, suffixes: tuple[str, ...] = (".py", ".txt", ".md"), seq: int = 256) -> dict:
    """Train a small Llama draft on `corpus` (folders) against the target's logits (KL + next-token
    CE). The target is anything `exactspec.load` takes (HF folder, GGUF file, hub id); the draft is
    an HF folder with the target's tokenizer."""
    from .. import load
    teacher = load(target, dtype="bfloat16", max_context=seq + 1)
    if teacher.tokenizer is None:
        raise CheckpointError(f"{target}: has no tokenizer (the draft must share the target's tokenizer)")
    folders = [corpus] if isinstance(corpus, Path) else list(corpus)
    files = [f for c in folders for f in corpus_files(c, suffixes)]
    texts = read_texts([f for f in files if not is_validation(f)])
    val_texts = read_texts([f for f in files if is_validation(f)]) or texts[:1]
    eos = teacher.eos_token_ids[0] if teacher.eos_token_ids else 0
    eos_text = teacher.tokenizer.tok.id_to_token(eos)
    data = tokenize(texts, teacher.tokenizer.tok, eos_text)
    val = tokenize(val_texts, teacher.tokenizer.tok, eos_text)
    tc = teacher.cfg
    heads = max(1, hidden // 64)
    student = llama(tc.vocab_size, hidden, layers, heads, 1 if heads == 1 else heads // 2 or 1, hidden * 3, eos,
                    tc.max_position_embeddings)
    spec = TrainSpec(minutes=minutes, lr=3e-3, seq=seq, batch=8, warmup=20)  # few, slow steps: short warmup
    stats = train(student, data, val, spec, teacher=exactspec_teacher(teacher), desc="distill")
    stats.update(teacher=str(target), corpus=[str(c) for c in folders], corpus_tokens=int(len(data)),
                 params=sum(p.numel() for p in student.parameters()))
    save(student, out, teacher.tokenizer, eos, stats)
    return stats
