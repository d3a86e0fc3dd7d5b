"""llguidance (what exactspec uses) vs xgrammar on this CPU, on the demo model's 49k-token vocabulary:
the time to make one vocabulary's matcher data, to compile each of bench/structured.py's 22 schemas, and
to compute one token's mask, replayed over the constrained answers exactspec gives those schemas (the
same token sequences for both); and which of a list of JSON Schema keywords each one takes or refuses.

    pip install --no-deps --target /tmp/xgt xgrammar apache-tvm-ffi   # xgrammar without its torch/triton pins
    PYTHONPATH=/tmp/xgt python bench/grammar_engines.py [--model PATH]

Figures are medians of per-call times (time.perf_counter) on one thread of this process."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import exactspec
from exactspec.decode import constraint as C
from exactspec.text import chat
from common import default_model, table
from structured import SCHEMAS

KEYWORDS = {  # a schema for each keyword beyond the common ones (type, properties, required, enum, items)
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}$"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "minimum/maximum": {"type": "integer", "minimum": 3, "maximum": 17},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}},
                   "required": ["x"]},
    "const": {"const": "yes"},
    "format: date": {"type": "string", "format": "date"},
    "format: email": {"type": "string", "format": "email"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "multipleOf": {"type": "integer", "multipleOf": 5},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    a = ap.parse_args()
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    m = exactspec.load(default_model(a.model))
    V = m.cfg.vocab_size
    prompts = [m.encode_text(chat.render(m.tokenizer.config, [{"role": "user", "content": f"Extract the facts of "
                                                               f"this text as JSON.\n\n{t}"}])) for t, _ in SCHEMAS]
    answers = [m.generate(p, 160, json_schema=s, num_draft_tokens=0).token_ids for p, (_, s) in zip(prompts, SCHEMAS)]

    t = time.perf_counter()
    vocab = C.Vocab(m.tokenizer.tok.to_str(), V, m.eos_token_ids)
    ll_vocab = time.perf_counter() - t
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=m.tokenizer.tok), vocab_size=V,
                                              stop_token_ids=list(m.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    xg_vocab = time.perf_counter() - t

    res = {"llguidance": {"compile": [], "mask": []}, "xgrammar": {"compile": [], "mask": []}}
    for (_, s), ids in zip(SCHEMAS, answers):
        t = time.perf_counter()
        g = C.make_grammar(vocab, "json_schema", s)
        mt = C.Matcher(g)
        res["llguidance"]["compile"].append(time.perf_counter() - t)
        for tok in ids:
            t = time.perf_counter()
            mt.mask()
            res["llguidance"]["mask"].append(time.perf_counter() - t)
            mt.advance([tok])
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(", ", ": "))
        xm = xgr.GrammarMatcher(cg)
        res["xgrammar"]["compile"].append(time.perf_counter() - t)
        bits = xgr.allocate_token_bitmask(1, V)
        for tok in ids:
            t = time.perf_counter()
            xm.fill_next_token_bitmask(bits)
            np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:V]  # as exactspec uses a mask
            res["xgrammar"]["mask"].append(time.perf_counter() - t)
            if not xm.accept_token(tok):
                res["xgrammar"].setdefault("refused", 0)
                res["xgrammar"]["refused"] += 1
                break
    ms = lambda xs: f"{1e3 * statistics.median(xs):.3f}"  # noqa: E731
    rows = [("llguidance", f"{ll_vocab:.2f}", ms(res["llguidance"]["compile"]), ms(res["llguidance"]["mask"]),
             f"{1e3 * max(res['llguidance']['mask']):.2f}", "0"),
            ("xgrammar", f"{xg_vocab:.2f}", ms(res["xgrammar"]["compile"]), ms(res["xgrammar"]["mask"]),
             f"{1e3 * max(res['xgrammar']['mask']):.2f}", str(res["xgrammar"].get("refused", 0)))]
    table(("engine", "vocabulary s", "compile ms (median of 22)", "mask ms per token (median)", "mask ms max",
           "exactspec's answers it refused"), rows,
          f"{len(SCHEMAS)} schemas, {sum(map(len, answers))} answer tokens, {m.folder.name} ({V} tokens)")
    rows = []
    for name, schema in KEYWORDS.items():
        out = []
        try:
            C.make_grammar(vocab, "json_schema", schema)
            out.append("takes")
        except Exception as e:
            out.append(f"refuses ({str(e)[:60]})")
        try:
            compiler.compile_json_schema(json.dumps(schema))
            out.append("takes")
        except Exception as e:
            out.append(f"refuses ({str(e)[:60]})")
        rows.append((name, *out))
    table(("keyword", "llguidance", "xgrammar"), rows, "JSON Schema keywords (takes: compiles; not checked: enforced)")


if __name__ == "__main__":
    main()
