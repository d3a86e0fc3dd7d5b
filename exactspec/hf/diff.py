"""Why do two greedy outputs of the same model differ? Find the first divergent token and say
whether rounding noise can explain it.

    report = exactspec.hf.diff.compare(model, prompt_ids, {}, {"assistant_model": draft})
    report = exactspec.hf.diff.explain(model, tokens_a, tokens_b, prompt_len=12)

At the first position p where the sequences differ (run A chose token a, run B token b), the
common prefix's next-token logits are recomputed in several ways that round differently in a
batch-variant model: the whole prefix in one forward, the last token alone on a cache, every
token one at a time (plain decoding: the cached keys were computed by 1-row calls too), and the
position as every row o of a c-row call on a cache (c = 2..8: a verify chunk of drafts, wherever in
the chunk the position fell). The spread of those logits is the measured run-to-run noise.
`compare` also has each run's own logits at p (transformers' output_logits).

Verdict "numerical near-tie": the a-vs-b gap, and the difference between the two runs' logits,
are within that noise (noise bound = NOISE_FACTOR x the largest measured difference). Otherwise
"not explained by numerics": the runs computed different things (cache, positions, masking) or did
not pick their own argmax (a logits processor, sampling). On a model under exactspec.hf.patch the
measured noise is exactly zero, so any divergence there is a logic bug.
"""
from __future__ import annotations

import copy
import inspect
from typing import Sequence

import torch

from ..errors import InvalidRequest

NOISE_FACTOR = 4.0
NEAR_TIE = "numerical near-tie"
NOT_NUMERICS = "not explained by numerics"


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or None if one sequence is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def _forward(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    if cache is None:
        return model(ids, use_cache=False).logits[0].float()
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(ids, use_cache=True, **{key: cache}).logits[0].float()


def _new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def recompute(model, prefix: Sequence[int], after: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Next-token logits (float32, (V,)) after `prefix`, computed several ways. `after`: tokens that
    followed in a run, used to place the position as the first row of a longer call."""
    ids = torch.tensor([list(prefix)])
    n = ids.shape[1]
    out = {}
    with torch.no_grad():
        out["whole prefix in one call"] = _forward(model, ids)[-1]
        cache = _new_cache(model)  # plain decoding: every earlier key and value computed one token at a time
        for i in range(n):
            z = _forward(model, ids[:, i:i + 1], cache)[-1]
        out["every token one at a time on a cache"] = z
        for o in range(8):  # position p as row o + 1 of a c-row call on a cache (a verify chunk)
            if o + 1 >= n:
                break
            base = _new_cache(model)
            _forward(model, ids[:, :n - 1 - o], base)
            for c in range(max(2, o + 1), 9):
                if c - 1 - o > len(after):
                    break
                cache = copy.deepcopy(base)
                chunk = torch.cat([ids[:, n - 1 - o:], torch.tensor([list(after[:c - 1 - o])], dtype=ids.dtype)], 1)
                out[f"row {o + 1} of {c} on a cache"] = _forward(model, chunk, cache)[o]
            if o == 0:
                out["one token on a cache"] = _forward(model, ids[:, n - 1:], copy.deepcopy(base))[-1]
    return out


def _measured_noise(model, tokens: list[int], p: int) -> tuple[dict[str, torch.Tensor], float]:
    """The recomputations of position p's logits, and their largest difference from the whole-prefix one."""
    runs = recompute(model, tokens[:p], tokens[p:])
    ref = runs["whole prefix in one call"]
    return runs, max(float((z - ref).abs().max()) for z in runs.values())


def _top2(z: torch.Tensor) -> tuple[list[dict], float]:
    v, i = z.topk(2)
    return [{"token": int(i[k]), "logit": float(v[k])} for k in range(2)], float(v[0] - v[1])


def _token(tokenizer, t: int) -> dict:
    d = {"id": t}
    if tokenizer is not None:
        d["text"] = tokenizer.decode([t])
    return d


def _prepare(a: Sequence[int], b: Sequence[int], prompt_len: int) -> int | None:
    p = first_divergence(a, b)
    if p is not None and p < max(prompt_len, 1):
        raise InvalidRequest(f"the sequences differ at position {p}, inside the prompt (length {prompt_len}): "
                                   "they are not two runs from the same prompt")
    return p


def _base(p: int | None, a: Sequence[int], b: Sequence[int], prompt_len: int) -> dict:
    if p is None:
        why = "identical" if len(a) == len(b) else "one sequence is a prefix of the other (EOS or length limit)"
        return {"diverged": False, "detail": why, "length_a": len(a), "length_b": len(b)}
    return {"diverged": True, "position": p, "new_token_index": p - prompt_len}


def explain(model, tokens_a: Sequence[int], tokens_b: Sequence[int], prompt_len: int = 0, tokenizer=None) -> dict:
    """Two greedy outputs (prompt + generated ids) of `model`, logits unknown: recompute at the
    first divergence and judge from the recomputations alone."""
    a, b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    p = _prepare(a, b, prompt_len)
    report = _base(p, a, b, prompt_len)
    if p is None:
        return report
    ta, tb = a[p], b[p]
    runs, noise = _measured_noise(model, a, p)
    ref = runs["whole prefix in one call"]
    gap = float(ref[ta] - ref[tb])
    bound = NOISE_FACTOR * noise
    near = abs(gap) <= bound
    top2, top2_gap = _top2(ref)
    report.update({
        "token_a": _token(tokenizer, ta), "token_b": _token(tokenizer, tb),
        "top2": top2, "top2_gap": top2_gap,
        "gap_a_minus_b": gap,
        "logit_difference": noise,  # the runs' own logits are unknown here: the recomputations' spread
        "noise": noise, "noise_bound": bound,
        "computations": {k: {"argmax": int(z.argmax()), "logit_a": float(z[ta]), "logit_b": float(z[tb]),
                             "max_abs_difference_from_whole_prefix": float((z - ref).abs().max())}
                         for k, z in runs.items()},
        "verdict": NEAR_TIE if near else NOT_NUMERICS,
        "reason": (f"a and b are {abs(gap):.3g} apart, within the measured noise bound {bound:.3g}: either "
                   "can win depending on how the forward was batched" if near else
                   f"a leads b by {gap:.3g}, beyond the measured noise bound {bound:.3g}: rounding cannot swap "
                   "them; look for a cache, position or masking bug" if gap > 0 else
                   f"b leads a by {-gap:.3g} (beyond the noise bound {bound:.3g}), so run A did not pick the "
                   "argmax of this prefix: look for a cache, position or masking bug in run A"),
    })
    return report


def _generate(model, prompt_ids: torch.Tensor, settings: dict, max_new_tokens: int):
    s = dict(settings)
    if s.get("do_sample"):
        raise InvalidRequest("diff explains greedy runs: do_sample=True in a setting")
    s.update(do_sample=False, output_logits=True, return_dict_in_generate=True)
    s.setdefault("max_new_tokens", max_new_tokens)
    s.setdefault("pad_token_id", getattr(model.generation_config, "pad_token_id", None) or 0)
    # an explicit mask: transformers masks out prompt tokens equal to the pad id (SmolLM2's pad is
    # <|im_end|>, which every chat prompt contains) when it has to infer one
    s.setdefault("attention_mask", torch.ones_like(prompt_ids))
    with torch.no_grad():
        out = model.generate(prompt_ids, **s)
    return out.sequences[0].tolist(), [z[0].float() for z in out.logits]


def compare(model, prompt_ids: Sequence[int] | torch.Tensor, settings_a: dict, settings_b: dict,
            max_new_tokens: int = 256, tokenizer=None) -> dict:
    """Run `model.generate(prompt, **settings)` twice (greedy; e.g. {} and {"assistant_model": d}),
    then report the first divergence with each run's own logits there."""
    ids = torch.as_tensor(prompt_ids).reshape(1, -1)
    n = ids.shape[1]
    a, za = _generate(model, ids, settings_a, max_new_tokens)
    b, zb = _generate(model, ids, settings_b, max_new_tokens)
    p = _prepare(a, b, n)
    report = _base(p, a, b, n)
    report.update({"tokens_a": a[n:], "tokens_b": b[n:]})
    if p is None:
        return report
    ta, tb = a[p], b[p]
    la, lb = za[p - n], zb[p - n]
    _, noise = _measured_noise(model, a, p)
    bound = NOISE_FACTOR * noise
    diff = float((la - lb).abs().max())
    gap_a, gap_b = float(la[ta] - la[tb]), float(lb[tb] - lb[ta])  # each run's margin for its own choice
    near = diff <= bound and abs(gap_a) <= bound and abs(gap_b) <= bound
    if near:
        reason = (f"the runs' logits differ by {diff:.3g} and each run's margin for its token is under "
                  f"{max(gap_a, gap_b):.3g}, within the measured noise bound {bound:.3g}")
    elif gap_a < 0 or gap_b < 0:
        reason = ("a run did not choose the argmax of its own logits (a logits processor, sampling or "
                  "selection logic differs between the settings)")
    else:
        reason = (f"the runs' logits at this position differ by {diff:.3g}, beyond the measured noise bound "
                  f"{bound:.3g}: they did not compute the same prefix (cache, positions, masking)")
    (top2_a, gap2_a), (top2_b, gap2_b) = _top2(la), _top2(lb)
    report.update({
        "token_a": _token(tokenizer, ta), "token_b": _token(tokenizer, tb),
        "top2_a": top2_a, "top2_b": top2_b, "top2_gap_a": gap2_a, "top2_gap_b": gap2_b,
        "margin_a": gap_a, "margin_b": gap_b,
        "logit_difference": diff,
        "noise": noise, "noise_bound": bound,
        "verdict": NEAR_TIE if near else NOT_NUMERICS,
        "reason": reason,
    })
    return report


# ---------------------------------------------------------------------------------------------
# CLI helpers: load a transformers model from a local folder, parse a generation setting.
# ---------------------------------------------------------------------------------------------

def load_hf(path: str, dtype: str = "float32"):
    """A transformers causal LM from a local checkpoint folder, a .gguf file (transformers' own
    GGUF loading) or a cached hub id (never the network unless the hub cache lacks it)."""
    from ..errors import CheckpointError
    from ..model.checkpoint import is_gguf, resolve
    folder = resolve(path)
    gguf = is_gguf(folder)
    if not gguf and not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder or a .gguf file)")
    try:
        import transformers
    except ImportError:
        raise CheckpointError("exactspec diff runs transformers' generate(): pip install 'exactspec[hf]'") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    where, kw = (folder.parent, {"gguf_file": folder.name}) if gguf else (folder, {})
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype),
                                                                  local_files_only=True, **kw)
    except (OSError, ValueError, ImportError) as e:
        raise CheckpointError(f"{folder}: transformers cannot load it ({e})") from None
    return model.eval()


def parse_setting(text: str, draft=None) -> dict:
    """'greedy' | 'assisted' | 'assisted:K' | 'lookup:N' -> generate() keyword arguments."""
    name, _, arg = text.partition(":")
    if name == "greedy" and not arg:
        return {}
    if name == "assisted":
        if draft is None:
            raise InvalidRequest(f"setting {text!r} needs --draft (an assistant checkpoint folder)")
        kw: dict = {"assistant_model": draft}
        if arg:
            kw["num_assistant_tokens"] = _positive(arg, text)
            kw["num_assistant_tokens_schedule"] = "constant"
        return kw
    if name == "lookup":
        return {"prompt_lookup_num_tokens": _positive(arg or "4", text)}
    raise InvalidRequest(f"setting {text!r}: expected greedy, assisted, assisted:K or lookup:N")


def _positive(arg: str, text: str) -> int:
    if not arg.isdigit() or int(arg) < 1:
        raise InvalidRequest(f"setting {text!r}: {arg!r} is not a positive integer")
    return int(arg)


def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise InvalidRequest(f"{what}: expected comma-separated token ids, got {text[:40]!r}") from None
    if not ids:
        raise InvalidRequest(f"{what}: no token ids")
    return ids
