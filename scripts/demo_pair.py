"""Train the shipped demo pair on the Python standard library's own source, offline, on the CPU.

    python scripts/demo_pair.py --out demo [--target-minutes 45 --draft-minutes 20]

1. byte-level BPE tokenizer (HF tokenizers), vocabulary 4096, trained on Lib/**/*.py
2. target: Llama, hidden 384, 6 layers, 6 heads / 2 KV heads, ~11M parameters
3. draft: Llama, hidden 192, 2 layers, ~1.6M parameters, distilled from the target's logits
Both saved as HF checkpoint folders with bfloat16 weights: exactspec/assets/target, exactspec/assets/draft.
A progress bar shows time left, loss and tokens/s. About 70 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exactspec.tools import distill as T  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="exactspec/assets")
    ap.add_argument("--corpus", default=str(T.stdlib_folder()))
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--target-minutes", type=float, default=45)
    ap.add_argument("--draft-minutes", type=float, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    tdir, ddir = out / "target", out / "draft"
    files = T.corpus_files(Path(a.corpus))
    train_files = [f for f in files if not T.is_validation(f)]
    texts = T.read_texts(train_files)
    val_texts = T.read_texts([f for f in files if T.is_validation(f)])
    print(f"corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} M characters for training")
    T.train_tokenizer(texts, a.vocab, tdir)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    data = T.tokenize(texts, tok)
    val = T.tokenize(val_texts, tok)
    print(f"tokens: {len(data) / 1e6:.2f} M train, {len(val) / 1e6:.2f} M validation")
    eos = tok.token_to_id(T.EOS)
    target = T.llama(a.vocab, 384, 6, 6, 2, 1024, eos)
    print(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f} M parameters")
    stats = T.train(target, data, val, T.TrainSpec(minutes=a.target_minutes, lr=2e-3), desc="target")
    print("target:", json.dumps(stats))
    from exactspec.text.tokenizer import Tokenizer as ExactTokenizer
    T.save(target, tdir, ExactTokenizer.from_folder(tdir), eos,
           {**stats, "corpus": "Python standard library Lib/**/*.py"})
    dstats = T.distill(tdir, Path(a.corpus), ddir, minutes=a.draft_minutes, hidden=192, layers=2, suffixes=(".py",))
    print("draft:", json.dumps(dstats))


if __name__ == "__main__":
    main()
