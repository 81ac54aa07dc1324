"""`stage auto` on a model whose module names a pattern cannot spell (non-ASCII).

The report offered "the same split as stage lines (replace `stage auto` with them to
pin it): stage entrée, blocs[0:2] -> 0", which the parser refuses at the 'é'
(README: names in a pattern are ASCII). It now says which name no line can write.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.cli import main

MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.entrée = nn.Linear(8, 8)
        self.blocs = nn.ModuleList(Block() for _ in range(4))
        self.tête = nn.Linear(8, 2)

    def forward(self, x):
        x = self.entrée(x)
        for block in self.blocs:
            x = block(x)
        return self.tête(x)

def build_model():
    return Model()

def sample_batch(n, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)

def loss_fn(out, target):
    return F.mse_loss(out, target)
"""


def test_stage_auto_offers_no_stage_lines_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model.py").write_text(MODEL, encoding="utf-8")
    (tmp_path / "spec.par").write_text("mesh pp=2\nstage auto\n")
    assert main(["compile", str(tmp_path / "spec.par"), str(tmp_path / "model.py")]) == 0
    out = capsys.readouterr().out
    assert "the same split as stage lines" not in out
    assert "no `stage` lines write this split: 'entrée' cannot be named in a pattern" in out
