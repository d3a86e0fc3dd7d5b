"""README and docs/ name only what exists: every link, path, module, `exactspec` command and flag."""
import argparse
import importlib
import re
from pathlib import Path

import pytest

from exactspec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# flags of other programs that the pages quote in their commands (pip, cmake, llama.cpp's tools, lm_eval, ray)
EXTERNAL_FLAGS = {"--no-deps", "--no-compile", "--no-binary", "--build", "--target", "--model_args", "--tasks", "--address", "--head",
                  "--model", "--port", "--host", "--jinja", "--ctx-size", "--parallel", "--draft-max", "--draft-min",
                  "--spec-type", "--cache-reuse", "--n-gpu-layers", "--batch_size", "--output_path", "--limit",
                  "--seed", "--num_fewshot", "--threads", "--chat-template", "--system-tokens", "--clients",
                  "--dist"}  # pytest's


def _spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", rest) + [line for b in blocks for line in b.splitlines()]


def _cli() -> tuple[set[str], set[str]]:
    """(the exactspec subcommands, every flag of any of them)."""
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    return set(sub.choices), flags


def _scripts_text() -> str:
    return "\n".join(p.read_text() for d in ("bench", "scripts") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_are_live(page):
    text = page.read_text()
    bad = [t for t in re.findall(r"\]\(([^)\s]+)\)", text)
           if not t.startswith(("http://", "https://", "#")) and not (page.parent / t.split("#")[0]).exists()]
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paths_modules_commands_and_flags_exist(page):
    commands, flags = _cli()
    scripts = _scripts_text()
    bad = []
    for span in _spans(page.read_text()):
        for path in re.findall(r"(?<![\w.~/-])((?:exactspec|tests|bench|docs|scripts|\.ci|kernels|decode|model|text|"
                               r"serve|hf)/[\w./-]*[\w/])(?:::(\w+))?", span):
            p, name = path
            hit = next((q for q in (ROOT / p, ROOT / "exactspec" / p) if q.exists()), None)
            if hit is None:
                bad.append(f"path {p}")
            elif name and hit.is_file() and name not in hit.read_text():
                bad.append(f"{p}::{name}")
        for mod in re.findall(r"\bexactspec(?:\.[a-z_]\w*)+", span):
            parts = mod.split(".")
            for n in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:n]))
                except ImportError:
                    continue
                try:
                    for attr in parts[n:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    bad.append(f"module {mod}")
                break
        for cmd in re.findall(r"(?:^|[\s(])exactspec (\w+)", span):
            if cmd not in commands:
                bad.append(f"command exactspec {cmd}")
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span):
            if flag not in flags and flag not in EXTERNAL_FLAGS and flag not in scripts:
                bad.append(f"flag {flag}")
    assert not bad, sorted(set(bad))


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    ci = (ROOT / ".ci" / "run").read_text()
    tests = next(line for line in lines if "pytest" in line and line.startswith("python3.11 -m venv"))
    assert tests in ci  # the README's test command is what CI runs
