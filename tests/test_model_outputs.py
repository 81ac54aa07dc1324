"""Forward's output: which one parc trains on (compiler/model_output.py).

A dict, a tuple or a ModelOutput is reduced to one tensor from its structure:
the loss the model computes when sample_batch passes it the targets and the file
has no loss_fn, else the logits; the report says which, and what it leaves out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parc.cli import main
from parc.compiler.frontend import analyse
from parc.compiler.model_output import choose_output, eager_choice, targets_given
from parc.errors import ModelError

MODELS = Path(__file__).parent / "models"
DP2 = "mesh dp=2\n"


@pytest.mark.parametrize(
    ("found", "own", "path", "is_loss"),
    [
        ([(("loss",), 0, True), (("logits",), 3, True)], True, ("loss",), True),
        ([(("loss",), 0, True), (("logits",), 3, True)], False, ("logits",), False),
        ([((0,), 3, True), ((1,), 0, True)], True, (1,), True),  # nanoGPT (logits, loss)
        ([((0,), 3, True), ((1,), None, False)], True, (0,), False),  # (logits, None)
        ([((0,), 3, True), ((1,), 0, True)], False, (0,), False),  # (logits, aux loss)
        ([(("hidden",), 3, True), (("logits",), 3, True)], False, ("logits",), False),
        ([((), 0, True)], True, (), True),  # the loss alone, computed from given targets
        ([((), 0, True)], False, (), False),  # loss_fn's to judge
        ([((), 2, True)], True, (), False),  # one tensor of logits
    ],
)
def test_the_choice_follows_the_structure(
    found: list, own: bool, path: tuple, is_loss: bool
) -> None:
    choice = choose_output(found, own, "m.py")
    assert (choice.path, choice.is_loss) == (path, is_loss)


def test_an_output_without_a_tensor_to_train_on_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="returns no tensor of at least one dim"):
        choose_output([((0,), 0, True), ((1,), None, False)], False, "m.py")


def test_the_eager_choice_is_the_traced_one() -> None:
    out = {"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)}
    assert eager_choice(out, True, "m.py").path == ("loss",)
    assert eager_choice((torch.zeros(2, 3), None), True, "m.py").path == (0,)


def test_targets_given_means_the_same_tensor_or_equal_values() -> None:
    y = torch.arange(6).view(2, 3)
    assert targets_given({"input_ids": y * 2, "labels": y}, y)
    assert targets_given((y * 2, y.clone()), y)
    assert not targets_given((y * 2,), y)


@pytest.mark.parametrize(
    ("file", "note"),
    [
        ("forward_returns_dict.py", "trains on output['logits']"),
        (
            "forward_returns_tuple.py",
            "trains on output[0]; not used: output[1] (loss_fn gets output[0] alone",
        ),
    ],
)
def test_a_structured_output_is_reported_and_trains_as_one_device(
    file: str, note: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "dp2.par"
    spec.write_text(DP2)
    assert note in analyse(spec, MODELS / file).plan.capture
    code = main(["check", str(spec), str(MODELS / file), "--steps", "2"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "EQUIVALENT" in out and "NOT EQUIVALENT" not in out


_TWO_HEADS = """
import torch, torch.nn as nn

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.cls, self.reg = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 1)

    def forward(self, x):
        z = torch.tanh(self.body(x))
        return {"logits": self.cls(z), "reg": self.reg(z)}

def build_model():
    return TwoHeads()

def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

def loss_fn(output, targets):
    return nn.functional.cross_entropy(output["logits"], targets) + output["reg"].square().mean()
"""


def test_a_head_only_a_left_out_output_reads_is_named_with_the_way_to_train_it(
    tmp_path: Path,
) -> None:
    # loss_fn gets output['logits'] alone: 'reg' is pruned, and its head's parameters with
    # it. The error said "forward never reads" them, which forward does.
    model = tmp_path / "two_heads.py"
    model.write_text(_TWO_HEADS)
    with pytest.raises(ModelError) as caught:
        analyse(DP2, model, batch=4)
    error = caught.value
    assert "the output parc trains on, output['logits'], never reads parameters" in error.message
    assert "'reg.weight'" in error.message
    assert "loss_fn gets output['logits'] alone" in (error.hint or "")


_SCALAR = """
import torch, torch.nn as nn

class Summed(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).sum()

def build_model():
    return Summed()

def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)
"""


def test_a_0d_output_without_loss_fn_or_given_targets_is_named_at_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No targets go to forward, so a 0-d output is no loss the model computes: the
    # default loss refuses it by its own message (was an IndexError inside parc's range
    # check of the targets, found by a probe).
    monkeypatch.chdir(tmp_path)  # parc run writes runs/ here
    model = tmp_path / "scalar.py"
    model.write_text(_SCALAR)
    spec = tmp_path / "dp2.par"
    spec.write_text(DP2)
    code = main(["run", str(spec), str(model), "--steps", "1"])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "forward returned a torch.float32 tensor of shape ()" in err, err
    assert "IndexError" not in err and "Traceback" not in err
