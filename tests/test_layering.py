"""The house's layering, read from the import graph with `ast` (every import, at module level or inside a function).

minillm is a ladder: the kernels (kernels/, imported as minillm_kernels) at the ground, then the core every lesson
stands on, a folder per technique, the engine that composes them, serving, the cluster of engines, the benches and
the course, then the entry points. An arrow may only point down the ladder (or sideways, on the same rung); the
graph has no cycle; the core stays small enough to read in an afternoon. A new module must be placed in LAYERS."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minillm"
PACKAGES = {"minillm": PACKAGE, "minillm_kernels": ROOT / "kernels"}  # import name -> folder (pyproject's package-dir)

# rung -> the modules (or folders: every module under them) on it; a module may import its own rung and below
LAYERS: list[tuple[str, list[str]]] = [
    ("kernels", ["minillm_kernels"]),  # the ground: Triton and C++ kernels, importing nothing of minillm
    ("core", ["minillm.config", "minillm.model", "minillm.sampling", "minillm.kv_cache", "minillm.request",
              "minillm.decode_loop", "minillm.attention"]),  # the package minillm.attention: the registry
    ("model file", ["minillm.gguf"]),
    ("techniques", ["minillm.attention.flash", "minillm.cache", "minillm.compile", "minillm.compress"]),
    ("techniques over the cache", ["minillm.speculative", "minillm.parallel"]),
    ("one-request front door", ["minillm.api"]),
    ("measuring tools", ["minillm.measure"]),  # timers, hardware, rooflines, workloads: benches, lessons and CLI
    ("engine", ["minillm.engine"]),
    ("recipes", ["minillm.recipes"]),  # what trains the shipped assets: above everything it trains with
    ("serving", ["minillm.serving"]),
    ("cluster", ["minillm.cluster"]),  # many engines (lesson 13) over the one-engine server (lesson 12)
    ("benches", ["minillm.bench"]),
    ("course", ["minillm.course"]),
    ("entry points", ["minillm", "minillm.__main__", "minillm.cli"]),
]
CORE_MAX_LINES = 1200
CORE = [rung_name for rung_name, _ in LAYERS].index("core")


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The minillm modules `name` imports (relative imports resolved; `from pkg import mod` counts as pkg.mod)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def rung(name: str) -> int:
    """The rung of a module: the most specific entry of LAYERS that contains it."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            inside = name == entry or (name.startswith(entry + ".") and entry != "minillm")  # "minillm": __init__
            if inside and len(entry) > best_len:
                best, best_len = i, len(entry)
    if best is None:
        raise AssertionError(f"{name} is on no rung: add it (or its folder) to LAYERS in tests/test_layering.py")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_is_on_a_rung(graph):
    for name in graph:
        rung(name)


def test_arrows_point_down_the_ladder(graph):
    upward = [f"{a} ({LAYERS[rung(a)][0]}) imports {b} ({LAYERS[rung(b)][0]})"
              for a, targets in sorted(graph.items()) for b in sorted(targets) if rung(b) > rung(a)]
    assert not upward, "imports that point up the ladder:\n" + "\n".join(upward)


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components: any component of more than one module is a cycle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_is_small(graph):
    core = [name for name in graph if rung(name) == CORE]
    lines = {name: len(modules()[name].read_text().splitlines()) for name in core}
    assert sum(lines.values()) <= CORE_MAX_LINES, f"the core has grown to {sum(lines.values())} lines: {lines}"


def test_the_checker_sees_a_violation(tmp_path):
    """The graph reader is not vacuous: an upward import and a cycle in a made-up package are found."""
    known = {"minillm.model", "minillm.engine.llm"}
    src = tmp_path / "model.py"
    src.write_text("def f():\n    from .engine import llm\n")
    assert imports_of("minillm.model", src, known) == {"minillm.engine.llm"}
    assert rung("minillm.engine.llm") > rung("minillm.model")


def test_the_kernels_are_on_the_map(graph):
    """kernels/ is read as minillm_kernels: its modules are in the graph, on the ground rung, and an import of
    minillm from a kernel file would point up the ladder."""
    kernels = [name for name in graph if name.startswith("minillm_kernels")]
    assert "minillm_kernels.cpu_lowbit" in kernels and all(rung(k) == 0 for k in kernels)
    assert any(t.startswith("minillm_kernels") for targets in graph.values() for t in targets)
    assert rung("minillm.model") > rung("minillm_kernels.flash_attn")

def test_readme_lists_the_core_with_its_size(graph):
    """README's "Read the core first" table names every core module with its length (give or take 10 lines)."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    for name in (n for n in graph if rung(n) == CORE):
        rel = modules()[name].relative_to(PACKAGE.parent).as_posix()
        row = re.search(rf"^\| `{re.escape(rel)}` \| (\d+) \|", readme, flags=re.M)
        assert row, f"README's core table does not list {rel}"
        lines = len(modules()[name].read_text().splitlines())
        assert abs(int(row.group(1)) - lines) <= 10, f"README says {rel} has {row.group(1)} lines; it has {lines}"
    total = sum(len(modules()[n].read_text().splitlines()) for n in graph if rung(n) == CORE)
    said = re.search(r"^\| \| \*\*([\d,]+)\*\* \|", readme, flags=re.M)
    assert said, "README's core table has no total row (| | **N** | ...)"
    assert abs(int(said.group(1).replace(",", "")) - total) <= 10, f"README's core total is {said.group(1)}: {total}"
