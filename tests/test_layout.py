"""The house follows the data path: each package imports only from packages below it, no module
grows past ~450 lines, and production code carries no test hooks."""
import ast
import re
from pathlib import Path

import exactspec

PKG = Path(exactspec.__file__).parent
# Lowest first. A module may import from its own room and from rooms before it, never after.
LAYERS = [
    {"errors", "jsonfile"},
    {"kernels"},
    {"text"},
    {"model"},
    {"decode"},
    {"api", "receipt"},
    {"hf"},
    {"serve"},
    {"cli", "demo", "fetch", "train", "head_train", "testing", "__init__"},
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _room(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(room imported, line) of every exactspec import in `path`, at any depth (lazy imports count)."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(PKG).parent.parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
                names = [target[0]] if target else [a.name.split(".")[0] for a in node.names]
            elif node.module and node.module.split(".")[0] == "exactspec":
                parts = node.module.split(".")[1:]
                names = [parts[0]] if parts else [a.name for a in node.names]
            else:
                continue
            out += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], node.lineno) for a in node.names
                    if a.name.startswith("exactspec.")]
    return out


def test_no_room_imports_from_a_room_above_it():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        room = _room(path)
        for target, line in _imports(path):
            if target in RANK and RANK[target] > RANK[room]:
                bad.append(f"{path.relative_to(PKG)}:{line} ({room}) imports {target}")
            assert target in RANK or target in ("load", "set_num_threads"), f"{path}:{line}: unknown room {target}"
    assert not bad, bad


def test_every_module_is_in_a_known_room():
    assert {_room(p) for p in PKG.rglob("*.py")} <= set(RANK)


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_no_fault_injection_hook_in_production_code():
    """Tests inject faults by wrapping the model (tests/serve/serving.py's Gated, tests/decode's _FailsOn)."""
    hits = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"FAULT_MARKER|fail_on_purpose|_injected_fault|\bfault=|\.fault\b", line)]
    assert not hits, hits


def test_uvicorn_is_pinned_below_an_untested_release():
    """serve/asgi.py subclasses uvicorn's private H11Protocol: an unpinned uvicorn may break it."""
    import tomllib
    deps = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    (uv,) = [d for d in deps if re.match(r"uvicorn\b", d)]
    assert "<" in uv, uv
