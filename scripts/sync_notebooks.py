"""Copy each lesson's cell sources from lessons/NN_name.py into the committed lessons/NN_name.ipynb, keeping its
outputs: for an edit that changes no result (a rename, a moved import, a typo). A lesson whose cells were added,
removed or reordered must be re-executed instead: python scripts/build_lessons.py lessons/NN_name.py

    python scripts/sync_notebooks.py                 # every lesson
    python scripts/sync_notebooks.py lessons/01_kv_cache.py
    python scripts/sync_notebooks.py --new-cells lessons/06_fusion_compile.py

--new-cells is for a machine that cannot execute the lesson now: cells are matched to the notebook's by their
sources (difflib), matched and edited cells keep their outputs, added cells come in without outputs, removed ones go.
The notebook then shows stale or missing outputs until it is re-executed with build_lessons.py.
"""

from __future__ import annotations

import difflib
import json
import sys
import uuid
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _blank(new) -> dict:
    """A notebook cell for a cell of the .py that the notebook does not have yet: its source, no outputs."""
    cell = {"cell_type": new.cell_type, "id": uuid.uuid4().hex[:8], "metadata": {},
            "source": new.source.splitlines(keepends=True)}
    if new.cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _aligned(want: list, cells: list[dict]) -> list[dict]:
    """The notebook's cells re-ordered to the .py's: matched by (type, source); a run of replaced cells of the same
    types pairs up in order (an edit: the old outputs stay); anything else unmatched is added blank or dropped."""
    a = [(c["cell_type"], _source(c).strip()) for c in cells]
    b = [(c.cell_type, c.source.strip()) for c in want]
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out += cells[i1:i2]
        elif op == "replace" and [t for t, _ in a[i1:i2]] == [t for t, _ in b[j1:j2]]:
            out += cells[i1:i2]  # same shape: edited in place; the loop in sync() copies the new sources
        else:  # insert, delete, or a replace that changes the cells' count or types
            out += [_blank(c) for c in want[j1:j2]]
    return out


def sync(src: Path, new_cells: bool = False) -> bool:
    """True if the notebook changed; raises if the two no longer have the same cells (unless new_cells)."""
    want = [c for c in jupytext.read(src).cells if c.cell_type in ("code", "markdown")]
    path = src.with_suffix(".ipynb")
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] in ("code", "markdown")]
    changed = False
    if [c.cell_type for c in want] != [c["cell_type"] for c in cells]:
        if not new_cells:
            raise SystemExit(f"{path.name}: cells were added, removed or reordered; re-execute it with "
                             f"python scripts/build_lessons.py {src.relative_to(ROOT)} (or, where it cannot run "
                             f"now, sync it with --new-cells and re-execute it later)")
        nb["cells"] = cells = _aligned(want, cells)
        changed = True
    for new, cell in zip(want, cells):
        if _source(cell).strip() != new.source.strip():
            cell["source"] = new.source.splitlines(keepends=True)
            changed = True
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


if __name__ == "__main__":
    args = sys.argv[1:]
    new_cells = "--new-cells" in args
    paths = [Path(p).resolve() for p in args if p != "--new-cells"] or sorted(
        (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    for p in paths:
        print(f"{p.with_suffix('.ipynb').relative_to(ROOT)}: {'updated' if sync(p, new_cells) else 'unchanged'}")
