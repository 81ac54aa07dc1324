"""The default loss' range check of the targets (compiler/default_loss.py): every target in
[0, classes) or F.cross_entropy's ignore index -100, else a ModelError naming the range seen.
The check reads the targets' min and max first and tests element-wise only when a target
is negative, so the cases below cover each way through it."""

from __future__ import annotations

import pytest
import torch

from parc.compiler.default_loss import DefaultLoss
from parc.errors import ModelError


@pytest.mark.parametrize(
    "targets",
    [[0, 3, 2], [-100, 1, 3], [-100, -100], [3], []],
    ids=["in-range", "ignored", "all-ignored", "last-class", "empty"],
)
def test_targets_in_range_or_ignored_pass(targets: list[int]) -> None:
    DefaultLoss("model.py").check_range_of(torch.tensor(targets, dtype=torch.long), 4)


@pytest.mark.parametrize(
    ("targets", "seen"),
    [
        ([-1, 0, 2], "from -1 to -1"),
        ([-100, -5, 1], "from -5 to -5"),  # the ignore index beside another negative one
        ([0, 4], "from 4 to 4"),
        ([-100, 7, 9], "from 7 to 9"),
    ],
    ids=["negative", "negative-beside-ignored", "past-the-last-class", "ignored-and-too-high"],
)
def test_targets_out_of_range_name_what_was_seen(targets: list[int], seen: str) -> None:
    for dtype in (torch.long, torch.int32):
        with pytest.raises(ModelError, match=f"targets {seen} outside \\[0, 4\\)"):
            DefaultLoss("model.py").check_range_of(torch.tensor(targets, dtype=dtype), 4)
