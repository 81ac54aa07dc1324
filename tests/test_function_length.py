"""No function in the compiler or the runtime runs past ~60 lines (STYLE: functions
under ~60), so each reads as one step of an algorithm.

A function's length is its `def` line through its last line, without its docstring
(a long explanation is welcome; a long body is not).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "runtime")
MAX_LINES = 60


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    span = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    first = node.body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        span -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return span


def long_functions(root: Path = ROOT) -> list[str]:
    """`path:line name (n lines)` for every function over MAX_LINES in PACKAGES."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                functions = ast.FunctionDef | ast.AsyncFunctionDef
                if isinstance(node, functions) and (n := _length(node)) > MAX_LINES:
                    rel = path.relative_to(root)
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_sixty_lines() -> None:
    assert long_functions() == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "compiler").mkdir()
    (tmp_path / "runtime").mkdir()
    (tmp_path / "compiler" / "long.py").write_text(f'def f():\n    """Doc."""\n{body}\n')
    short = 'def g():\n    """A\n    doc."""\n    return 1\n'
    (tmp_path / "runtime" / "short.py").write_text(short)
    assert long_functions(tmp_path) == [f"compiler/long.py:1 f ({MAX_LINES + 1} lines)"]
