"""The shipped draft for SmolLM2-135M-Instruct (exactspec/assets/smollm2-draft), built offline on 2 cores:

1. `exactspec distill` against SmolLM2 on the Python standard library + /usr/share/doc
   (KL to the target's logits + next-token CE; teacher = exactspec's own bf16 forward):
       exactspec distill --target <smollm2.gguf> --corpus /usr/lib/python3.11 /usr/share/doc \\
           --out /tmp/distill/smollm2-draft --minutes 45 --hidden 192 --layers 2
2. this script: SmolLM2's own greedy chat answers (what the draft must predict when serving) to
   chat prompts made from the standard library (one per documented function and module), then
   the distilled draft fine-tuned on those transcripts (next-token CE).

    python scripts/smollm2_draft.py --init /tmp/distill/smollm2-draft --out exactspec/assets/smollm2-draft \\
        [--gen-minutes 12] [--train-minutes 15]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import exactspec
from exactspec.text import chat
from exactspec.tools import fetch
from exactspec.tools import head_train as HT
from exactspec.tools import distill as T

GENERAL = HT.GENERAL


def stdlib_prompts(limit: int, seed: int = 0) -> list[str]:
    """Chat prompts from the standard library: one per documented function, one per module."""
    return HT.stdlib_prompts(limit, seed, edits=False)


def generate(model, prompts: list[str], minutes: float, batch: int, max_new: int) -> list[list[int]]:
    seqs, t0 = [], time.time()
    for i in range(0, len(prompts), batch):
        if time.time() - t0 > minutes * 60:
            break
        texts = [chat.render(model.tokenizer.config, [{"role": "user", "content": p}]) for p in prompts[i:i + batch]]
        for text, r in zip(texts, model.generate_batch(texts, max_new)):
            seqs.append(model.encode(text) + r.token_ids + list(model.eos_token_ids[:1]))
        n = sum(map(len, seqs))
        print(f"{len(seqs)} transcripts, {n} tokens, {n / (time.time() - t0):.0f} tok/s", flush=True)
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True, help="the distilled draft to start from")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gen-minutes", type=float, default=12.0)
    ap.add_argument("--train-minutes", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--data", default="/tmp/smollm2_transcripts.json", help="cache of the generated transcripts")
    a = ap.parse_args()
    import transformers as tf
    data_path = Path(a.data)
    if data_path.is_file():
        seqs = json.loads(data_path.read_text())
    else:
        target = exactspec.load(fetch.smollm2(), dtype="bfloat16", max_context=512)
        prompts = GENERAL + stdlib_prompts(4000)
        seqs = generate(target, prompts, a.gen_minutes, a.batch, a.max_new_tokens)
        data_path.write_text(json.dumps(seqs))
    flat = np.asarray([t for s in seqs for t in s], dtype=np.uint16)
    cut = int(len(flat) * 0.97)
    student = tf.AutoModelForCausalLM.from_pretrained(a.init, dtype=torch.float32)
    spec = T.TrainSpec(minutes=a.train_minutes, lr=1e-3, batch=16, seq=256, warmup=20)
    stats = T.train(student, flat[:cut], flat[cut:], spec, desc="fine-tune on SmolLM2 transcripts")
    prior = json.loads((Path(a.init) / "training.json").read_text())
    meta = {"distill": prior, "finetune": {**stats, "transcripts": len(seqs), "tokens_available": int(len(flat))}}
    from exactspec.text.tokenizer import Tokenizer
    T.save(student, Path(a.out), Tokenizer.from_folder(Path(a.init)), int(student.config.eos_token_id), meta)
    print(json.dumps(meta["finetune"], indent=2))


if __name__ == "__main__":
    main()
