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
    {"kernels", "cuda"},
    {"text"},
    {"model"},
    {"decode"},
    {"api", "receipt"},
    {"hf"},
    {"serve"},
    {"cli", "tools", "__init__"},
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


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(module imported, the names taken from it, line) of every exactspec import in `path`, lazy ones too."""
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("exactspec")):
            base = here[: len(here) - (node.level - 1)] if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            for a in node.names:
                sub = ".".join(mod + [a.name])
                out.append((sub, [], node.lineno) if sub in known else (".".join(mod), [a.name], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in known]
    return out


def test_no_underscore_name_is_imported_across_packages():
    """A package's private names stay inside it: what another package needs is public."""
    known = {_module(p) for p in PKG.rglob("*.py")}
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        pkg = _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module(path)
        for mod, names, line in _module_imports(path, known):
            target = mod if mod in known and not (PKG / Path(*mod.split(".")[1:]) / "__init__.py").exists() else mod + ".x"
            if target.rsplit(".", 1)[0] != pkg and any(n.startswith("_") and not n.startswith("__") for n in names):
                bad.append(f"{path.relative_to(PKG)}:{line} imports {names} from {mod}")
    assert not bad, bad


def test_no_import_cycle_lazy_ones_included():
    """No two modules import each other, directly or round a loop, at module level or inside a function
    (a lazy import hides a circle, it does not open it); a package's __init__ re-exporting its modules is
    not a cycle."""
    known = {_module(p) for p in PKG.rglob("*.py")}
    graph = {_module(p): {m for m, _, _ in _module_imports(p, known) if m in known and m != _module(p)}
             for p in PKG.rglob("*.py")}
    for m in graph:  # a package imported for its submodules: the edge is to what its __init__ imports
        graph[m] -= {m.rsplit(".", 1)[0]} if m.count(".") > 1 else set()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles
