"""Chat templates from tokenizer_config.json, rendered with jinja2 the way transformers does
(sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, add_generation_prompt)."""
from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequest


class TemplateError(InvalidRequest):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _token(cfg: dict, key: str) -> str:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v or ""


def template_source(tokenizer_config: dict) -> str | None:
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def render(tokenizer_config: dict, messages: list[dict], add_generation_prompt: bool = True) -> str:
    source = template_source(tokenizer_config)
    if source is None:
        raise TemplateError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
    try:
        return _compile(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=_token(tokenizer_config, "bos_token"),
                                       eos_token=_token(tokenizer_config, "eos_token"))
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from None
