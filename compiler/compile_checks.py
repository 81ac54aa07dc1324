"""The `compile` statement against the rest of the spec (compiler/resolve.py, step 5).

`compile` (runtime/compiled.py) runs every stage graph through torch.compile. A
statement whose promise a compiled stage would break is refused at the `compile`
line, one row of `_NOT_WITH_COMPILE` each.
"""

from __future__ import annotations

from collections.abc import Callable

from parc.dsl.ast import Compile, ScheduleKind, Spec
from parc.errors import PlanError

__all__ = ["check_compile"]

# What `compile` cannot be combined with yet: (applies, why, what to write instead).
_NOT_WITH_COMPILE: tuple[tuple[Callable[[Spec], bool], str, str], ...] = (
    (
        lambda spec: spec.schedule is ScheduleKind.ZB1,
        "`schedule zb1`: zb1 splits each backward into its input and weight parts by "
        "walking the stage's autograd graph, and a compiled stage's backward is one node",
        "use `schedule 1f1b` or `interleaved` with `compile`",
    ),
)


def check_compile(spec: Spec) -> bool:
    """Resolve step 5: `compile`, refused where a statement's promise would not hold compiled."""
    node = spec.statement(Compile)
    if node is None:
        return False
    for applies, why, instead in _NOT_WITH_COMPILE:
        if applies(spec):
            raise PlanError(
                f"`compile` with {why}; that combination is not built",
                spec.locate(node.span),
                hint=f"{instead}, or drop `compile`",
            )
    return True
