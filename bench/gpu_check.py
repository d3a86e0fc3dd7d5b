"""The seed thread's setting on a CUDA GPU: transformers' assisted generation of a Llama-2-7B-shape model in
bfloat16 with a small assistant, unpatched vs under exactspec.hf.patch (exactspec.cuda's Triton kernels);
then the kernels' invariance checks on the device. One command, nothing installed or downloaded:

    python bench/gpu_check.py [--prompts 6] [--tokens 128] [--shape 7b|1b|tiny] [--budget 360] [--json OUT]

Models are random (fixed seeds; no download): the target in Llama-2-7B's shape (32 layers, hidden
4096, 32 heads, intermediate 11008, vocabulary 32000), the assistant a 2-layer Llama of hidden 512 on the
same vocabulary. Prompts are random token ids (32 each; 6 by default). For each of unpatched / patched: plain greedy,
assisted (assistant_model) and prompt lookup (prompt_lookup_num_tokens=4) per prompt, `--tokens` new
tokens each (eos ignored); how many prompts' assisted / lookup output leaves that run's greedy output,
and tokens/s of each (prompt included in the timing, one prompt at a time, after one warm-up prompt).

Kernel checks (exactspec.cuda.kernels at the target's shapes): each kernel's rows computed alone, in
every row count 1..17 and beside other rows, compared bitwise; next to them torch's own matmul, whose
rows are expected to change with the row count on a GPU (the seed's cause).

Dry run on a CPU (the logic only; minutes): TRITON_INTERPRET=1 python bench/gpu_check.py --shape tiny
--device cpu --prompts 2 --tokens 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "7b": (4096, 32, 32, 32, 11008, 32000),
    "1b": (2048, 16, 32, 8, 8192, 32000),
    "tiny": (64, 2, 4, 2, 192, 320),
}


def llama(shape: tuple, seed: int, device: str, dtype: torch.dtype):
    import transformers as tf
    hidden, layers, heads, kv, inter, vocab = shape
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.LlamaForCausalLM._from_config(cfg, torch_dtype=dtype)
    return model.eval()


def generate(model, ids: torch.Tensor, n: int, **kw) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, **kw)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_modes(target, draft, prompts: list[torch.Tensor], n: int, device: str) -> dict:
    """Per mode: tokens/s over all prompts and how many prompts leave greedy's output."""
    modes = {"greedy": {}, "assisted": dict(assistant_model=draft), "lookup": dict(prompt_lookup_num_tokens=4)}
    for kw in modes.values():  # warm-up (Triton compiles, cuBLAS picks): not timed
        generate(target, prompts[0], 4, **kw)
    out: dict = {}
    greedy = []
    for name, kw in modes.items():
        sync(device)
        t0 = time.perf_counter()
        outs = [generate(target, p, n, **kw) for p in prompts]
        sync(device)
        dt = time.perf_counter() - t0
        if name == "greedy":
            greedy = outs
        diverged = sum(not torch.equal(a, b) for a, b in zip(outs, greedy))
        out[name] = dict(tok_s=len(prompts) * n / dt, diverged=diverged)
        print(f"  {name}: {out[name]['tok_s']:.1f} tok/s, {diverged}/{len(prompts)} diverge from greedy", flush=True)
    return out


def kernel_checks(shape: tuple, device: str, dtype: torch.dtype) -> list[tuple[str, str, bool, float]]:
    """(check, what was compared, bitwise equal, max |error| against the float64 twin)."""
    from exactspec.cuda import kernels as K
    hidden, _, heads, kv, inter, vocab = shape
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=g, device=device).to(dtype)

    rows = []
    x, w = randn(17, hidden), randn(inter, hidden) * hidden ** -0.5
    full = K.matmul(x, w)
    same = all(torch.equal(K.matmul(x[:m], w), full[:m]) for m in range(1, 18))
    other = x.clone()
    other[1:] = randn(16, hidden)
    same &= torch.equal(K.matmul(other, w)[0], full[0])
    err = (full.double() - K.matmul_ref(x, w)).abs().max().item()
    rows.append(("exactspec matmul", f"({inter}x{hidden}) rows 1..17 and beside others", same, err))
    tfull = x @ w.T
    tsame = all(torch.equal(x[:m] @ w.T, tfull[:m]) for m in range(1, 18))
    rows.append(("torch matmul (for contrast)", f"({inter}x{hidden}) rows 1..17", tsame,
                 (tfull.double() - K.matmul_ref(x, w)).abs().max().item()))
    for name, fn, ref, n in (("rmsnorm", lambda t: K.rmsnorm(t, 1e-6), lambda t: K.rmsnorm_ref(t, 1e-6), hidden),
                             ("softmax", K.softmax, lambda t: torch.softmax(t.double(), -1), vocab),
                             ("log_softmax", K.log_softmax, lambda t: torch.log_softmax(t.double(), -1), vocab)):
        t = randn(9, n) * 4
        full = fn(t)
        same = all(torch.equal(fn(t[i:i + 1])[0], full[i]) for i in range(9))
        rows.append((name, f"9 rows of {n}, each alone", same, (full.double() - ref(t)).abs().max().item()))
    D, T = hidden // heads, 300
    q, k, v = randn(1, heads, T, D), randn(1, kv, T, D), randn(1, kv, T, D)
    causal = (torch.arange(T, device=device)[None, :] <= torch.arange(T, device=device)[:, None])[None]
    full = K.attention(q, k, v, causal, D ** -0.5)
    same = True
    for t in range(T - 17, T):  # decode rows over the cache so far, and verify blocks of 1..17 rows
        one = K.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal[:, t:t + 1, :t + 1], D ** -0.5)
        same &= torch.equal(one[:, 0], full[:, t])
    for m in range(1, 18):
        part = K.attention(q[:, :, T - m:], k, v, causal[:, T - m:], D ** -0.5)
        same &= torch.equal(part, full[:, T - m:])
    err = (full.double() - K.attention_ref(q, k, v, causal, D ** -0.5)).abs().max().item()
    rows.append(("attention", f"{heads}/{kv} heads of {D}, 300 keys: decode rows, verify blocks 1..17", same, err))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=360.0, help="seconds for the generation runs (fewer prompts if needed)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import transformers as tf
    import exactspec.hf as H
    tf.logging.set_verbosity_error()
    dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {gpu}; torch {torch.__version__}; transformers {tf.__version__}; "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}", flush=True)
    t0 = time.perf_counter()
    shape = SHAPES[a.shape]
    target = llama(shape, 0, a.device, dtype)
    small = (512, 2, 8, 8, 1536, shape[5]) if a.shape != "tiny" else (32, 2, 4, 2, 96, shape[5])
    draft = llama(small, 1, a.device, dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, shape[5], (1, 32), generator=gen).to(a.device) for _ in range(a.prompts)]
    t1 = time.perf_counter()  # one greedy answer, to fit the runs in --budget (a slower GPU: fewer prompts)
    generate(target, prompts[0], a.tokens)
    sync(a.device)
    per = time.perf_counter() - t1
    fit = max(2, int(a.budget / (per * 9)))  # 3 modes unpatched, 3 patched: allow the patched ones 2x
    if fit < len(prompts):
        print(f"one answer took {per:.1f} s: {fit} prompts fit --budget {a.budget:.0f} s, not {len(prompts)}")
        prompts = prompts[:fit]
        a.prompts = fit
    print(f"models made in {t1 - t0:.0f} s; unpatched:", flush=True)
    results = {"device": gpu, "shape": a.shape, "prompts": a.prompts, "tokens": a.tokens}
    results["unpatched"] = run_modes(target, draft, prompts, a.tokens, a.device)
    print("patched (exactspec.hf.patch, Triton kernels):", flush=True)
    with H.patch(target, backend="triton"):
        results["patched"] = run_modes(target, draft, prompts, a.tokens, a.device)
    print("kernel checks:", flush=True)
    results["kernels"] = kernel_checks(shape, a.device, dtype)

    print(f"\n{gpu}, random Llama ({a.shape}) bf16, assistant 2 layers, {a.prompts} prompts x {a.tokens} tokens\n")
    print("| run | greedy tok/s | assisted tok/s | diverged (assisted) | lookup tok/s | diverged (lookup) |")
    print("|---|---|---|---|---|---|")
    for run in ("unpatched", "patched"):
        r = results[run]
        print(f"| {run} | {r['greedy']['tok_s']:.1f} | {r['assisted']['tok_s']:.1f} | {r['assisted']['diverged']}/"
              f"{a.prompts} | {r['lookup']['tok_s']:.1f} | {r['lookup']['diverged']}/{a.prompts} |")
    print("\n| kernel check | compared | bitwise equal | max abs error vs float64 |\n|---|---|---|---|")
    for name, what, same, err in results["kernels"]:
        print(f"| {name} | {what} | {'yes' if same else 'NO'} | {err:.3g} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = results["patched"]["assisted"]["diverged"] == 0 and results["patched"]["lookup"]["diverged"] == 0
    ok &= all(same for name, _, same, _ in results["kernels"] if not name.startswith("torch"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
