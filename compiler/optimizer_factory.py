"""The type of a model's optimizer factory: parameters in, a torch optimizer out.

One definition for the compiler's optimizer checks, the runtime's assembly and
launcher, and the Python API. It imports no torch at run time, so the CLI's
launcher can name it without paying torch's import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["OptimizerFactory"]

OptimizerFactory = Callable[[Iterable["torch.nn.Parameter"]], "torch.optim.Optimizer"]
