"""Stubs give the contract, hints give a ladder, and neither gives the code.

A stub's docstring states what its function must do (inputs, outputs, invariants, a worked example); its
NotImplementedError is only a pointer to that docstring and to `minillm hint NN`. The hints climb in three levels:
a nudge, a contract detail or trap, then the recipe in words. These tests fail when any of that text (a stub's
docstrings, messages and comments, or any hint level) contains a line of the solution's code, whitespace and quote
style aside. Lines that say nothing by themselves (`return x`, `else:`, imports, decorators, signatures) and code the
stub itself hands the learner (a given `__init__`) are not counted.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

from minillm.course.grading import TASKS

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "solutions").glob("ex*.py"))
POINTER = re.compile(r"^task (\d\d)\.(\w+): see the docstring; `minillm hint \1 \2` for hints$")
MIN_CHARS = 10  # a normalised line shorter than this (`n=len(x)`) is too generic to count as the answer


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text).replace('"', "'")


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _trivial(line: str) -> bool:
    s = line.strip()
    return (len(_norm(s)) < MIN_CHARS or s.startswith(("def ", "class ", "@", "import ", "from ", "#"))
            or s in ("pass", "return", "else:", "try:", "finally:", "break", "continue")
            or not re.search(r"\w", s))


def _balanced(line: str) -> bool:
    return all(line.count(a) == line.count(b) for a, b in ("()", "[]", "{}"))


def code_lines(source: str, names: set[str] | None = None) -> set[str]:
    """The normalised, non-trivial code lines of the top-level functions/classes `names` (all when None), docstrings
    and comments dropped: each statement as ast.unparse writes it (one line each), and each physical source line."""
    tree = ast.parse(source)
    out: set[str] = set()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or (names is not None and node.name not in names):
            continue
        seg = ast.get_source_segment(source, node) or ""
        # physical lines that are whole statements (a continuation line alone, `raise OutOfBlocksError(`, is not)
        physical = [ln for ln in (ln.split("#")[0] if "#" in ln and "'" not in ln and '"' not in ln else ln
                                  for ln in seg.splitlines()) if _balanced(ln)]
        unparsed = ast.unparse(_strip_docstrings(ast.parse(ast.unparse(node)))).splitlines()
        docs = {_norm(c.value) for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        for ln in [*unparsed, *physical]:
            n = _norm(ln)
            if not _trivial(ln) and n not in docs and not any(n and n in d for d in docs):
                out.add(n)
    return out


def stub_text(source: str) -> str:
    """Everything a learner reads in a stub that is not code: every string constant (docstrings, messages) and
    every comment, normalised into one string."""
    parts = [c.value for c in ast.walk(ast.parse(source)) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    parts += [t.string.lstrip("#") for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type == tokenize.COMMENT]
    return _norm(" ".join(parts))


def leaked_lines(text_norm: str, module: str) -> list[str]:
    """The solution's code lines of `module` that appear in `text_norm`, less the code its stub already gives."""
    sol = importlib.import_module(f"solutions.{module}")
    answer = code_lines((ROOT / "solutions" / f"{module}.py").read_text(), set(sol.SAME_AS))
    given = code_lines((ROOT / "exercises" / f"{module}.py").read_text())
    return sorted(line for line in answer - given if line in text_norm)


def test_the_leak_check_catches_code_in_prose():
    solution = ("def f(ids, n, k):\n    '''doc'''\n    for i in range(len(ids) - n - 1, -1, -1):\n"
                "        return ids[i + n:i + n + k]\n    return []\n")
    lines = code_lines(solution)
    assert _norm("returnids[i+n:i+n+k]") in lines and _norm("return []") not in lines
    assert any(line in stub_text('"""walk back: for i in range(len(ids) - n - 1, -1, -1): ..."""') for line in lines)
    assert not any(line in stub_text('"""the tokens after the match, at most k"""') for line in lines)


@pytest.mark.parametrize("module", MODULES)
def test_no_stub_contains_solution_code(module):
    text = stub_text((ROOT / "exercises" / f"{module}.py").read_text())
    leaked = leaked_lines(text, module)
    assert not leaked, (f"exercises/{module}.py shows lines of its solution's code (in a docstring, message or "
                        f"comment): {leaked}; state the contract instead, and put the recipe, in words, in hint 3")


@pytest.mark.parametrize("module", MODULES)
def test_every_stub_raises_a_pointer(module):
    """The NotImplementedError says which task and where to read; the contract is in the docstring."""
    lesson = module[2:4]
    tasks = {m.split("_", 2)[2] for m, _ in TASKS[lesson]}
    tree = ast.parse((ROOT / "exercises" / f"{module}.py").read_text())
    raised = 0
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        for node in ast.walk(fn):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "NotImplementedError":
                raised += 1
                msg = ast.literal_eval(node.exc.args[0]) if node.exc.args else ""
                match = POINTER.match(msg)
                assert match and match.group(1) == lesson and match.group(2) in tasks, (
                    f"exercises/{module}.py:{node.lineno} ({fn.name}): the message should be the pointer "
                    f"'task {lesson}.<task>: see the docstring; `minillm hint {lesson} <task>` for hints', got {msg!r}")
                doc = ast.get_docstring(fn) or ""
                assert len(doc) >= 80, f"exercises/{module}.py: {fn.name}'s docstring must state its contract"
    assert raised, f"exercises/{module}.py has no stub"


@pytest.mark.parametrize("lesson", list(TASKS))
def test_every_task_has_three_hint_levels_without_solution_code(lesson):
    from minillm.course.hints import HINTS, hint

    modules = [m for m in MODULES if m[2:4] == lesson]
    for marker, _ in TASKS[lesson]:
        levels = HINTS.get(marker)
        assert levels and len(levels) == 3 and all(s.strip() for s in levels), (
            f"{marker}: minillm/course/tasks.toml needs exactly three levels (nudge, contract detail, recipe)")
        assert "yet)" not in levels[2], f"{marker}: no level-3 recipe written in minillm/course/tasks.toml"
        task = marker.split("_", 2)[2]
        for level, text in enumerate(levels, 1):
            shown = _norm(hint(lesson, task, level))
            assert _norm(text) in shown and all(_norm(o) not in shown for o in levels if o != text), (
                f"{marker}: `minillm hint {lesson} {task} --level {level}` must show level {level} alone")
            for module in modules:
                leaked = leaked_lines(_norm(text), module)
                assert not leaked, f"{marker} hint level {level} contains solution code of {module}: {leaked}"
