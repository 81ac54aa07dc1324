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
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.entrée = nn.Linear(16, 16)
        self.blocs = nn.ModuleList(Block() for _ in range(4))
        self.tête = nn.Linear(16, 4)

    def forward(self, x):
        x = self.entrée(x)
        for block in self.blocs:
            x = block(x)
        return self.tête(x)

def build_model():
    return Model()

def sample_batch(n, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)

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


def test_parc_plan_writes_stage_lines_that_parse_and_pin_its_cuts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It wrote `stage entrée, blocs[0:2] -> 0`, which `parc compile` refused at the 'é'.
    (tmp_path / "model.py").write_text(MODEL, encoding="utf-8")
    spec, model = tmp_path / "plan.par", str(tmp_path / "model.py")
    cluster = "nodes=1 gpus=2 mem=20KiB preset=h100"  # too small for dp=2: a pipeline
    assert main(["plan", model, "--cluster", cluster, "--batch", "8", "-o", str(spec)]) == 0
    text = spec.read_text()
    assert "mesh pp=2" in text and "stage blocs[0:2] -> 0\nstage blocs[2:4] -> 1\n" in text
    capsys.readouterr()
    assert main(["compile", str(spec), model, "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "entrée, blocs[0:2]" in out and "blocs[2:4], tête" in out  # the planner's cuts


def test_cuts_no_stage_line_can_pin_fall_back_to_stage_auto_and_say_why() -> None:
    from parc.compiler.planner.spec_out import _stage_lines

    lines = _stage_lines(("a", "tête", "b"), (), (1,), 1)  # 'tête' starts stage 1
    assert lines[1:] == ["stage auto"] and "no stage line can name 'tête'" in lines[0]
