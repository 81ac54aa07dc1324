"""Python asserts on shapes inside a traced forward: checked at the traced shapes, then dropped.

torch.fx cannot branch on a traced value, and `assert t <= block_size` (with
`b, t = idx.size()`) is such a branch. But the shapes parc traces at are known
(the sample batch's), and an assert only ever raises: it never changes what
forward computes. So the tracer lets the assert pass (`to_bool` returns True
for a condition that is an assert's test), remembers the fx node of the
condition, and after tracing:

1. evaluates every remembered condition in a fake forward at the sample inputs
   (compiler/saved.py `evaluate_nodes`: only the nodes it needs, no memory);
2. a condition that is False is the AssertionError forward would raise when run
   eagerly on that batch: a CompileError quoting the assert and its operands;
3. a condition that is a tensor (`assert (x > 0).all()`) depends on values no
   trace can know: a CompileError saying so and how to drop the assert;
4. removes the condition nodes and whatever only they used, as `python -O`
   removes the statement.

This is sound because parc runs the graph at those shapes only (every batch
has the sample batch's shapes: the runtime checks it), and the check is the
single-device model's (tensor-parallel rewriting comes later and never sees it).
An assert whose test chooses between values (`or`, `not`, `x if c else y`, a
comprehension) is not treated so: returning True there could change the
outcome, and it fails with the control-flow error instead.
"""

from __future__ import annotations

import ast
import functools
import operator
import os
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from parc.errors import CompileError

__all__ = ["ASSERT_FIX", "AssertSite", "TracedAssert", "assert_site", "check_asserts"]

# Frames of the tracer itself: torch.fx and parc's compiler. Any other frame
# (the model file, or a torch function it calls) is where the condition sits.
_TRACER_DIRS = (os.path.dirname(torch.fx.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
# Test expressions in which a True for one part may not be the whole test's value.
_CHOICE = (ast.IfExp, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.Lambda)
_SYMBOL: dict[Any, str] = {
    operator.lt: "<",
    operator.le: "<=",
    operator.eq: "==",
    operator.ne: "!=",
    operator.gt: ">",
    operator.ge: ">=",
}
ASSERT_FIX = (
    "remove the assert from forward (check the data in sample_batch instead), or run parc "
    "with asserts off: `PYTHONOPTIMIZE=1 parc ...` (what `python -O` does; the workers "
    "inherit it). torch._assert does not help: its condition would be traced and run on "
    "fake tensors and on tensor-parallel shards. Asserts on shapes (`x.size()`, `x.shape`) "
    "need no change: parc checks them at the traced shapes"
)


@dataclass(frozen=True, slots=True)
class AssertSite:
    """An `assert` statement in a source file."""

    file: str
    line: int
    code: str  # the statement's text, on one line

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.code}"


@dataclass(frozen=True, slots=True)
class TracedAssert:
    """A condition the tracer let pass: its fx node and the assert it is the test of."""

    node: torch.fx.Node
    site: AssertSite


def assert_site(frame: types.FrameType | None) -> AssertSite | None:
    """The assert whose test the innermost non-tracer frame of `frame` is evaluating, if any."""
    while frame is not None and frame.f_code.co_filename.startswith(_TRACER_DIRS):
        frame = frame.f_back
    if frame is None:
        return None
    file, line = frame.f_code.co_filename, frame.f_lineno
    for stmt, code in _asserts_in(file, _mtime(file)):
        test = stmt.test
        if test.lineno <= line <= (test.end_lineno or test.lineno):
            return None if _chooses(test) else AssertSite(file, stmt.lineno, code)
    return None


def _mtime(file: str) -> float:
    try:
        return os.stat(file).st_mtime
    except OSError:
        return 0.0


@functools.lru_cache(maxsize=64)
def _asserts_in(file: str, mtime: float) -> tuple[tuple[ast.Assert, str], ...]:
    """Every assert statement of `file` with its text (`mtime` keys the cache)."""
    try:
        with open(file, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    lines = source.splitlines()
    found = []
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Assert):
            text = lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]
            found.append((stmt, " ".join(t.strip() for t in text)))
    return tuple(found)


def _chooses(test: ast.expr) -> bool:
    for node in ast.walk(test):
        if isinstance(node, _CHOICE):
            return True
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            return True
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return True
    return False


def check_asserts(
    gm: torch.fx.GraphModule, asserts: Sequence[TracedAssert], inputs: Sequence[Any] | None
) -> None:
    """Steps 1-4: check every traced assert at `inputs`' shapes, then drop it from `gm`."""
    if not asserts:
        return
    if inputs is None:
        first = asserts[0].site
        raise CompileError(
            f"`{first.code}` asserts on a traced value; parc checks such asserts at the "
            "sample inputs' shapes, and none were given",
            source=str(first),
            hint="pass the sample inputs: trace_model(model, inputs)",
        )
    # Step 1
    from .saved import evaluate_nodes

    operands = [a for t in asserts for a in t.node.args if isinstance(a, torch.fx.Node)]
    values = evaluate_nodes(gm, inputs, [t.node for t in asserts] + operands)
    for traced in asserts:
        value = values[traced.node]
        if isinstance(value, torch.Tensor):  # Step 3
            raise CompileError(
                f"the assert at {traced.site.file}:{traced.site.line} checks tensor values "
                f"(`{traced.site.code}`): parc traces forward with torch.fx, where a tensor "
                "has a shape but no values, so this condition cannot be known",
                source=str(traced.site),
                hint=ASSERT_FIX,
            )
        if not value:  # Step 2
            raise CompileError(
                f"the assert at {traced.site.file}:{traced.site.line} fails for the sample "
                f"batch: `{traced.site.code}`{_operands(traced.node, values)}; forward "
                "raises the same AssertionError when run eagerly on it",
                source=str(traced.site),
                hint="make sample_batch's shapes meet the assert (e.g. sequences no longer "
                "than the model's block size), or fix the model's configuration",
            )
    _drop(gm, [t.node for t in asserts])  # Step 4


def _operands(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> str:
    """` (here 16 <= 8)` for a comparison, else nothing."""
    symbol = _SYMBOL.get(node.target) if node.op == "call_function" else None
    if symbol is None or len(node.args) != 2:
        return ""
    left, right = (values.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args)
    return f" (here {left} {symbol} {right})"


def _drop(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> None:
    """Erase `nodes` and, transitively, every input left with no users (not placeholders)."""
    todo, gone = list(nodes), set()
    while todo:
        node = todo.pop()
        if node in gone or node.users or node.op in ("placeholder", "output"):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        gone.add(node)
        todo.extend(inputs)
    gm.graph.lint()
    gm.recompile()
