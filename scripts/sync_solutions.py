"""Copy each SAME_AS function of solutions/exNN_*.py from the engine module it mirrors (one source of truth).

    python scripts/sync_solutions.py          # rewrite drifted solutions in place, print what changed

tests/test_exercise_sync.py fails when a solution drifts; this script is the fix it asks for. Stubs (exercises/) are
edited by hand: only their signatures must match, their bodies are the task.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def sync(path: Path) -> list[str]:
    module = importlib.import_module(f"solutions.{path.stem}")
    text = path.read_text()
    changed = []
    for name, engine_module in getattr(module, "SAME_AS", {}).items():
        engine_src = inspect.getsource(getattr(importlib.import_module(engine_module), name))
        node = next(n for n in ast.parse(text).body if getattr(n, "name", None) == name)
        lines = text.splitlines(keepends=True)
        start = node.lineno - 1 - len(node.decorator_list)
        old = "".join(lines[start:node.end_lineno])
        if old != engine_src:
            text = "".join(lines[:start]) + engine_src + "".join(lines[node.end_lineno:])
            changed.append(f"{path.name}:{name}")
    path.write_text(text)
    return changed


if __name__ == "__main__":
    for p in sorted((ROOT / "solutions").glob("ex*.py")):
        for c in sync(p):
            print("synced", c)
