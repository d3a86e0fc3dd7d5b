"""Chat templates from tokenizer_config.json, rendered with jinja2 the way transformers does
(sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, add_generation_prompt)."""
from __future__ import annotations

import sys
from functools import lru_cache
from typing import Callable

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ExactSpecError, InvalidRequest


class TemplateError(InvalidRequest):
    """The chat template refused or could not render the messages (the client's input)."""


class ChatTemplateBroken(ExactSpecError):
    """The model's chat template itself is broken (the server's configuration, not the client)."""


def _raise(message: str) -> None:
    raise TemplateError(f"messages: {message}", "messages")


MAX_VALUE = 1 << 20  # elements (characters, list items) one `*` may build; digits of a `**` result, roughly


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox, plus bounds on the two operators that build huge values in one step
    (`'x' * 10**9`, `9 ** 9 ** 9`): range() is already bounded by the sandbox."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            n, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * n > MAX_VALUE:
                raise SecurityError(f"'*' would build {len(seq) * n} elements (limit {MAX_VALUE})")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(right) * max(abs(left), 2).bit_length() > 4 * MAX_VALUE:
            raise SecurityError(f"'**' would build a number of about {abs(right) * abs(left).bit_length()} bits")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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


MAX_STEPS = 2_000_000  # lines of template code and Python calls one rendering may run (a long chat: ~10-100 thousand)


class _Budget:
    """Counts the lines the template's own code runs and the Python calls it makes (a trace function on
    this thread) and stops the rendering past `steps`, or as soon as `cancelled()` says the client left.
    Steps, not seconds: whether a template renders is a function of the request, not of the load."""

    def __init__(self, steps: int, cancelled: Callable[[], bool] | None):
        self.left, self.cancelled = steps, cancelled

    def _line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise SecurityError("the template ran more than its budget of steps")
            if self.left % 4096 == 0 and self.cancelled is not None and self.cancelled():
                raise _Cancelled()
        return self._line

    def trace(self, frame, event, arg):  # 'call' events (any function the template calls is a step too)
        self._line(frame, "line", arg)  # and the lines of template code only
        return self._line if frame.f_code.co_filename == "<template>" else None

    def __enter__(self):
        self.saved = sys.gettrace()
        sys.settrace(self.trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.saved)


class _Cancelled(Exception):
    pass


def render(tokenizer_config: dict, messages: list[dict], add_generation_prompt: bool = True,
           max_chars: int | None = None, max_steps: int = MAX_STEPS,
           cancelled: Callable[[], bool] | None = None, tools: list[dict] | None = None) -> str:
    """The chat prompt as text. Errors: TemplateError (400: the template refused these messages
    with raise_exception, could not render them, rendered more than `max_chars`, or ran more than
    `max_steps` lines of its code: nested loops cannot pin a core); ChatTemplateBroken (the model's
    template itself does not compile: the server's fault). `cancelled()` true (the client left) stops
    the rendering with TemplateError too. `tools`: given to the template as transformers does (OpenAI's
    tool objects), when there are any."""
    source = template_source(tokenizer_config)
    if source is None:
        raise TemplateError("this model's tokenizer_config.json has no chat_template; use /v1/completions",
                            "messages")
    try:
        template = _compile(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateBroken(f"the model's chat template does not compile: {e}") from None
    out, n = [], 0
    try:  # rendered piece by piece, so a template cannot build a huge string before the limit bites
        with _Budget(max_steps, cancelled):
            for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=_token(tokenizer_config, "bos_token"),
                                           eos_token=_token(tokenizer_config, "eos_token"),
                                           **({"tools": tools} if tools else {})):
                n += len(piece)
                if max_chars is not None and n > max_chars:
                    raise TemplateError(f"messages: the rendered chat prompt exceeds {max_chars} characters",
                                        "messages")
                out.append(piece)
    except TemplateError:
        raise
    except _Cancelled:
        raise TemplateError("messages: the client left while the chat template rendered", "messages") from None
    except (jinja2.TemplateError, TypeError, ValueError, OverflowError, MemoryError, RecursionError,
            AttributeError, KeyError, IndexError) as e:  # the template could not render these messages
        raise TemplateError(f"messages: the chat template cannot render them ({type(e).__name__}: "
                            f"{str(e)[:200]})", "messages") from None
    return "".join(out)
