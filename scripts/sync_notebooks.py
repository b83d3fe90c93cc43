"""Copy each lesson's cell sources from lessons/NN_name.py into the committed lessons/NN_name.ipynb, keeping its
outputs: for an edit that changes no result (a rename, a moved import, a typo). A lesson whose cells were added,
removed or reordered must be re-executed instead: python scripts/build_lessons.py lessons/NN_name.py

    python scripts/sync_notebooks.py                 # every lesson
    python scripts/sync_notebooks.py lessons/01_kv_cache.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent


def sync(src: Path) -> bool:
    """True if the notebook changed; raises if the two no longer have the same cells."""
    want = [c for c in jupytext.read(src).cells if c.cell_type in ("code", "markdown")]
    path = src.with_suffix(".ipynb")
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] in ("code", "markdown")]
    if [c.cell_type for c in want] != [c["cell_type"] for c in cells]:
        raise SystemExit(f"{path.name}: cells were added, removed or reordered; re-execute it with "
                         f"python scripts/build_lessons.py {src.relative_to(ROOT)}")
    changed = False
    for new, cell in zip(want, cells):
        old = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if old.strip() != new.source.strip():
            cell["source"] = new.source.splitlines(keepends=True)
            changed = True
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    for p in paths:
        print(f"{p.with_suffix('.ipynb').relative_to(ROOT)}: {'updated' if sync(p) else 'unchanged'}")
