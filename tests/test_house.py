"""The house rules that can be read from the source: short functions, and draft kinds asked, not type-checked.

* No function in ``saguaro/`` is over 60 lines unless its docstring says why ("Long because ...").
* Only the builder (``saguaro/build.py``) may tell draft kinds apart by type: everywhere else a draft kind
  answers through its methods (``saguaro/drafts.py``), and a runner says whether it reads the target's
  features through the ``DraftRunner`` protocol, not a ``getattr`` with a default.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "saguaro"
MAX_LINES = 60
SOURCES = sorted(ROOT.rglob("*.py"))


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of each function over ``MAX_LINES`` lines whose docstring gives no reason."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES and "Long because" not in (ast.get_docstring(node) or ""):
                found.append((node.name, lines))
    return found


def test_the_rule_sees_a_long_function_and_its_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", MAX_LINES + 1)]
    assert long_functions(f'def f():\n    """Long because it must."""\n{body}') == []
    assert long_functions(f"def f():\n{body[:-10]}") == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_long_function_without_its_reason(path):
    assert long_functions(path.read_text()) == []


def test_draft_kinds_are_told_apart_only_in_the_builder():
    pattern = re.compile(r"isinstance\(.*EagleDraft|getattr\([^)]*reads_features")
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in SOURCES if path.name != "build.py" or path.parent != ROOT
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
