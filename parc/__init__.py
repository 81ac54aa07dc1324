"""parc: a declarative parallelism compiler for PyTorch.

program = parc.compile("specs/gpt_dp.par", "examples/gpt.py", batch=8)
loss = program.step(inputs, targets)      # on every rank
state = program.state_dict()              # the full, unsharded model, on rank 0 ({} elsewhere)
parc.finish()                             # at the end of a rank: exit without gloo's teardown

A model file's data(ctx) hook is given a parc.DataContext (compiler/data_context.py).
"""

from typing import TYPE_CHECKING

from parc.errors import (
    CompileError,
    ModelError,
    ParcError,
    PlanError,
    RuntimeFault,
    SpecError,
)

__all__ = [
    "CompileError",
    "DataContext",
    "ModelError",
    "ParcError",
    "PlanError",
    "Program",
    "RuntimeFault",
    "SpecError",
    "compile",
    "finish",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from parc.api import compile
    from parc.compiler.data_context import DataContext
    from parc.runtime.launch import exit_hard as finish
    from parc.runtime.program import Program


def __getattr__(name: str) -> object:
    # Imported lazily: `import parc` (e.g. for the CLI's error types) stays cheap.
    if name == "compile":
        from parc.api import compile

        return compile
    if name == "DataContext":  # what a model file's data(ctx) hook is given
        from parc.compiler.data_context import DataContext

        return DataContext
    if name == "finish":  # end a rank of the user's own loop: exit_hard's docstring
        from parc.runtime.launch import exit_hard

        return exit_hard
    if name == "Program":
        from parc.runtime.program import Program

        return Program
    raise AttributeError(f"module 'parc' has no attribute {name!r}")
