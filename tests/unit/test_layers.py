"""The package's shape: layers import downward only, no import circles, small modules.

Read from the source (ast), so it checks every import, top-level or deferred inside a function:
a deferred import that goes up a layer is still a dependency on that layer. The layers are
DESIGN.md v2's picture, lowest first; a module may import from its own layer or any below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import weighthub

SRC = Path(weighthub.__file__).parent
MAX_LINES = 400
LONG_ALLOWED = {"codec/kernels.py"}  # the numba kernel file: one place for every host kernel

# part (top-level module or package under weighthub) -> layer
LAYERS: dict[str, int] = {
    "errors": 0, "lazy": 0, "kernel_cache": 0, "nogc": 0,
    "tensors": 1,
    "digest": 2,
    "codec": 3,
    "format": 4,
    "store": 5, "chunking": 5, "layout": 5,
    "catalog": 6, "sources": 6, "net": 6,
    "targets": 7,
    "publish": 8, "receive": 8,
    "cluster": 9, "train": 9,  # train: LoGRA replay feeds the receive engine
    "engines": 10, "testing": 10,
    "demo": 11, "bench": 11, "integrations": 11,
    "cliargs": 11, "cli": 12, "cli_read": 12, "__main__": 12, "__init__": 12,
}
# what DESIGN.md says in words, checked on top of the layer order
FORBIDDEN = {
    ("codec", "net"), ("format", "net"), ("digest", "net"),
    ("codec", "cluster"), ("format", "cluster"), ("digest", "cluster"),
    ("net", "targets"), ("net", "receive"), ("net", "publish"), ("net", "train"),
    ("receive", "cluster"), ("publish", "cluster"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of weighthub that `mod` imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1] if node.level > 1 else here
                prefix = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("weighthub"):
                prefix = node.module.removeprefix("weighthub").lstrip(".")
            else:
                continue
            names = [f"{prefix}.{a.name}".lstrip(".") for a in node.names] + [prefix]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("weighthub").lstrip(".") for a in node.names
                     if a.name.startswith("weighthub.")]
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != mod:
                found.add(n)
    return found


def _part(mod: str) -> str:
    return mod.split(".")[0]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_every_part_has_a_layer() -> None:
    parts = {_part(m) for m in _modules()}
    assert parts <= LAYERS.keys(), f"give these a layer in LAYERS: {sorted(parts - LAYERS.keys())}"


def test_imports_go_down_the_layers() -> None:
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            a, b = _part(mod), _part(dep)
            if a == b:
                continue
            if LAYERS.get(b, 99) > LAYERS.get(a, 99) or (a, b) in FORBIDDEN:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layer order (DESIGN.md v2):\n  " + "\n  ".join(sorted(bad))


def test_no_import_circles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ re-exporting its own submodules is not a circle worth flagging
    real = [c for c in cycles if len({_part(m) for m in c}) > 1 or not any(
        m == _part(m) for m in c)]
    assert not real, f"import circles: {real}"


def test_modules_stay_small() -> None:
    long = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC).as_posix()
        n = len(p.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_ALLOWED:
            long[rel] = n
    assert not long, f"modules over {MAX_LINES} lines (split them by purpose): {long}"

