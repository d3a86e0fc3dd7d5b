"""The CLI's flags are made from ServeOptions' and SamplingParams' fields (name, type, default, help:
written once, in the dataclass) and built back into them by name: every field has its flag, and the
values arrive."""
import dataclasses

import pytest

import exactspec

from exactspec.cli import build_parser
from exactspec.decode.sampling import SamplingParams
from exactspec.serve.options import ServeOptions


def test_every_serve_option_has_a_flag_and_arrives(monkeypatch):
    monkeypatch.delenv("EXACTSPEC_API_KEY", raising=False)
    a = build_parser().parse_args(["serve", "--model", "m", "--max-batch", "3", "--read-timeout", "2.5",
                                   "--allowed-hosts", "a", "b", "--protect-metrics", "--api-key", "k"])
    missing = [f.name for f in dataclasses.fields(ServeOptions) if not hasattr(a, f.name)]
    assert not missing, missing
    o = ServeOptions.from_args(a)
    assert (o.max_batch, o.read_timeout, o.allowed_hosts, o.protect_metrics, o.api_key) == (3, 2.5, ("a", "b"), True, "k")
    defaults = ServeOptions.from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert defaults == ServeOptions()  # the flags' defaults are the options' defaults
    assert all(f.metadata.get("help") for f in dataclasses.fields(ServeOptions))  # each documented once, there
    monkeypatch.setenv("EXACTSPEC_API_KEY", "env-key")
    assert ServeOptions.from_args(build_parser().parse_args(["serve", "--model", "m"])).api_key == "env-key"


def test_every_sampling_parameter_has_a_generate_flag():
    a = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--top-k", "5", "--seed", "9"])
    got = {f.name: getattr(a, f.name) for f in dataclasses.fields(SamplingParams)}
    assert got["top_k"] == 5 and got["seed"] == 9
    assert SamplingParams(**got).top_k == 5


def test_sampling_params_or_keywords_not_both():
    from exactspec import InvalidRequest, make_request
    from exactspec.model.config import Limits
    lim = Limits(100, 50)
    a = make_request(lim, [1, 2], 4, SamplingParams(0.5, seed=3))
    b = make_request(lim, [1, 2], 4, temperature=0.5, seed=3)
    assert (a.prompt, a.params, a.max_new_tokens) == (b.prompt, b.params, b.max_new_tokens)
    assert make_request(lim, [1, 2], 4, SamplingParams(0.5, seed=None)).params.seed is not None  # drawn, reported
    with pytest.raises(InvalidRequest, match="not both"):
        make_request(lim, [1, 2], 4, SamplingParams(0.5), temperature=0.5)
    with pytest.raises(InvalidRequest, match="not a request argument"):
        make_request(lim, [1, 2], 4, temprature=0.5)


def test_serve_without_model_serves_the_demo_model(ckpt, monkeypatch):
    """`exactspec serve` with no --model: the demo's SmolLM2 file (here a stand-in), fetched as `demo` does."""
    from exactspec import cli
    from exactspec.tools import fetch
    from exactspec.serve import app
    folder = ckpt("qwen2")
    served = {}
    monkeypatch.setattr(fetch, "smollm2", lambda: folder)
    monkeypatch.setattr(app, "serve", lambda model, name, *a, **kw: served.update(folder=model.folder, name=name))
    assert cli.main(["serve", "--prefix-cache-mb", "0"]) == 0
    assert served == {"folder": folder, "name": folder.name}


def test_activations_flag_reaches_the_model(ckpt, monkeypatch):
    """`--activations` (serve and generate): int8 by default for quantized weights, float32 on request."""
    from exactspec import cli
    from exactspec.serve import app
    served = []
    monkeypatch.setattr(app, "serve", lambda model, *a, **kw: served.append(model.net))
    d = str(ckpt("qwen2"))
    assert cli.main(["serve", "--model", d, "--quantize", "q8_0", "--prefix-cache-mb", "0"]) == 0
    assert cli.main(["serve", "--model", d, "--quantize", "q8_0", "--activations", "float32", "--prefix-cache-mb", "0"]) == 0
    assert cli.main(["serve", "--model", d, "--prefix-cache-mb", "0"]) == 0
    assert [n.activations for n in served] == ["int8", "float32", "float32"]  # float weights: nothing to quantize
    assert served[0].layers[0].wqkv.fmt == "q8_0i" and served[1].layers[0].wqkv.fmt == "q8_0"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", d, "--prompt", "x", "--activations", "int4"])
    with pytest.raises(exactspec.UnsupportedModelError, match="activations='int4' is not supported"):
        exactspec.load(d, activations="int4")
