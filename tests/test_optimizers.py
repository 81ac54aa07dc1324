"""Optimizers under parallel layouts (issue 11.1, 12.7): elementwise ones train the
single-device model everywhere; the rest are refused where a layout would change
what they compute, before anything trains.

`compiler/optimizers.py` classifies by exact type (a table of torch.optim classes)
or by a probe; the probe is checked here against the table and against optimizers
with whole-tensor and global statistics. Then, on a gloo world of 2, each optimizer
of tests/models/mlp_optimizers.py is either refused or equivalent under `zero 1`,
and equivalent under `zero 0` (one device's tolerances: runtime/calibration.py,
the noise-twin bounds `parc check` uses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MLP, parc_main

from parc.compiler.frontend import analyse
from parc.compiler.optimizer_rebuild import rebuilt_like
from parc.compiler.optimizers import ELEMENTWISE, Locality, locality_of, optimizer_problem
from parc.errors import ParcError
from parc.runtime.check import compare_in_pool

MODELS = Path(__file__).parent / "models"
OPTIMIZERS = str(MODELS / "mlp_optimizers.py")
ADAFACTOR = str(MODELS / "mlp_adafactor.py")
DP2_ZERO1 = "mesh dp=2\nzero 1\n"
TP2 = "mesh tp=2\nshard layers[0] col tp\nshard layers[1] row tp\n"


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 3))]


def _made(name: str) -> torch.optim.Optimizer:
    import mlp_optimizers  # tests/models is on sys.path (the autouse fixture below)

    made: torch.optim.Optimizer = mlp_optimizers.OPTIMIZERS[name](_params())
    return made


@pytest.fixture(autouse=True)
def _models_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(MODELS))


# ------------------------------------------------------------------ classification

# Every class of the table with settings that change its update rule.
SETTINGS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True, "maximize": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"amsgrad": True, "foreach": True, "weight_decay": 0.1}),
    (torch.optim.Adam, {"fused": True}),
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True, "foreach": True}),
    (torch.optim.Adagrad, {"lr_decay": 0.1, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
    (torch.optim.Adamax, {"weight_decay": 0.1}),
    (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.Adadelta, {"weight_decay": 0.1}),
    (torch.optim.Rprop, {}),
    (torch.optim.ASGD, {"t0": 1.0, "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("cls", "kwargs"), SETTINGS, ids=lambda v: getattr(v, "__name__", ""))
def test_the_probe_finds_every_table_optimizer_elementwise(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    assert cls in ELEMENTWISE
    # A subclass misses the exact-type table, so the probe decides.
    probed = type(f"Probed{cls.__name__}", (cls,), {})
    assert locality_of(probed(_params(), **kwargs)) is Locality.ELEMENTWISE


def test_the_table_lists_each_class_of_the_settings() -> None:
    assert {cls for cls, _ in SETTINGS} == ELEMENTWISE


@pytest.mark.parametrize(
    ("made", "locality"),
    [
        (lambda: torch.optim.Adafactor(_params()), Locality.PER_TENSOR),
        (lambda: torch.optim.Muon(_params()), Locality.PER_TENSOR),
        (lambda: _made("trust-ratio"), Locality.PER_TENSOR),
        (lambda: _made("global-norm"), Locality.CROSS_TENSOR),
        (lambda: torch.optim.LBFGS(_params()), Locality.CLOSURE),
    ],
    ids=["Adafactor", "Muon", "TrustRatioSGD", "GlobalNormSGD", "LBFGS"],
)
def test_optimizers_with_whole_tensor_statistics_are_found(made: Any, locality: Locality) -> None:
    assert locality_of(made()) is locality


# ------------------------------------------------------------------ layout rules


@pytest.mark.parametrize(
    ("spec", "name", "says"),
    [
        (DP2_ZERO1, "adafactor", "zero 1 flattens the parameters"),
        ("mesh dp=2\nzero 3\n", "trust-ratio", "zero 3 flattens the parameters"),
        ("mesh dp=2\n", "adafactor", None),
        ("mesh dp=2\n", "global-norm", None),
        (TP2, "trust-ratio", "tp=2 gives each tp rank's optimizer a slice"),
        (TP2, "adamw", None),
        ("mesh pp=2\nstage auto\n", "global-norm", "pp=2 gives each pipeline stage's optimizer"),
        ("mesh pp=2\nstage auto\n", "adafactor", None),
        ("mesh dp=2\n", "lbfgs", "LBFGS.step needs a closure"),
        (DP2_ZERO1, "lbfgs", "LBFGS.step needs a closure"),
    ],
)
def test_a_layout_refuses_what_it_would_change(spec: str, name: str, says: str | None) -> None:
    plan = analyse(spec, MLP).plan
    problem = optimizer_problem(_made(name), plan)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem, problem


def test_parc_compile_warns_that_the_models_optimizer_will_be_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, spec = parc_main(tmp_path, "zero1.par", DP2_ZERO1, "compile", ADAFACTOR)
    assert code == 0
    out = capsys.readouterr().out
    assert f"{spec}:2:1: warning: configure_optimizer returns Adafactor: Adafactor is not " in out
    assert "`parc run` and `parc check` refuse it" in out


def test_parc_check_refuses_the_models_adafactor_under_zero_1(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "zero1.par", DP2_ZERO1, "check", ADAFACTOR)
    out, err = capfd.readouterr()
    assert code == 2, out + err
    line = _line_of(ADAFACTOR, "def configure_optimizer")
    assert err.startswith(
        f"{ADAFACTOR}: error: configure_optimizer (line {line}) returned Adafactor: Adafactor "
        "is not elementwise: it computes statistics over a whole tensor, and zero 1 flattens"
    ), err
    assert "hint: use zero 0 and no tp/pp for this optimizer, or an elementwise optimizer" in err
    assert "Traceback" not in out + err


def test_parc_check_names_the_users_line_a_rank_raised_at(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The factory raises on the ranks only: the user's line, as `parc run` names it, once
    # for both ranks (was a traceback through parc's frames, found by a probe).
    model = str(MODELS / "optimizer_raises_on_ranks.py")
    code, _ = parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "check", model)
    out, err = capfd.readouterr()
    assert code == 2, out + err
    line = _line_of(model, 'raise RuntimeError("no optimizer on a rank")')
    assert err.startswith(
        f"{model}: error: configure_optimizer raised RuntimeError: no optimizer on a rank\n"
        f"  at {model}:{line} in configure_optimizer:"
    ), err
    assert "(raised by ranks 0, 1 of 2 of the parallel run)" in err
    assert "Traceback" not in out + err and "leaked" not in err


def test_parc_check_uses_the_models_elementwise_optimizer_and_passes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _ = parc_main(tmp_path, "zero1.par", DP2_ZERO1, "check", MLP)
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "parc's default AdamW(lr=0.0003)" in out  # examples/mlp.py defines none
    assert "EQUIVALENT: the parallel run trains the same model as one device" in out


def _line_of(path: str, text: str) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line)


# ------------------------------------------------------------------ on a gloo world

TORCH_AND_WRITTEN = ["sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor", "trust-ratio"]
NOT_ELEMENTWISE = {"adafactor", "trust-ratio"}


def compile_on_rank(spec: str, model: str, env: dict[str, str]) -> str | None:
    """On every rank: parc.compile only; the ParcError it raised, as text (a case that
    returns keeps the pool's world: no restart)."""
    from parc.api import compile as parc_compile
    from parc.runtime.equivalence import model_env

    with model_env(env):
        try:
            parc_compile(spec, model, batch=8)
        except ParcError as err:
            return str(err)
    return None


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("name", TORCH_AND_WRITTEN)
def test_each_optimizer_is_refused_or_equivalent(gloo_pool: Any, name: str, zero: int) -> None:
    spec, env = f"mesh dp=2\nzero {zero}\n", {"MLP_OPTIMIZER": name}
    refused = zero >= 1 and name in NOT_ELEMENTWISE
    assert (optimizer_problem(_made(name), analyse(spec, MLP).plan) is not None) == refused
    if refused:
        errors = gloo_pool(2).run(compile_on_rank, spec, OPTIMIZERS, env)
        # Every rank refuses alike, naming the model file's configure_optimizer.
        assert len(set(errors)) == 1 and errors[0] is not None
        assert errors[0].startswith(f"{OPTIMIZERS}: error: configure_optimizer (line ")
        assert f"returned {type(_made(name)).__name__}: " in errors[0]
        return
    comparison, twin = compare_in_pool(gloo_pool(2), spec, OPTIMIZERS, steps=3, batch=8, env=env)
    assert twin is None
    assert comparison.ok, comparison.describe()


def test_lbfgs_is_refused_when_the_program_is_built(gloo_pool: Any) -> None:
    # Before: accepted under zero 1, and step 0 failed inside LBFGS.step (issue 12.7).
    env = {"MLP_OPTIMIZER": "lbfgs"}
    errors = gloo_pool(2).run(compile_on_rank, DP2_ZERO1, OPTIMIZERS, env)
    assert all(e is not None and "LBFGS.step needs a closure" in e for e in errors), errors


def _plan(zero: int) -> Any:
    return analyse(f"mesh dp=2\nzero {zero}\n", MLP).plan


class _ScaledSGD(torch.optim.SGD):
    """SGD whose step is scaled by an attribute kept outside its parameter groups."""

    def __init__(self, params: Any, lr: float = 0.1, scale: float = 1.0) -> None:
        super().__init__(params, lr=lr)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.scale)


class _LrRequired(torch.optim.SGD):
    """SGD whose constructor has no default lr."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)


def test_zero_refuses_an_optimizer_whose_settings_a_rebuild_would_lose() -> None:
    # ZeRO builds the class again over each shard: `scale` would silently become 1.0.
    opt = _ScaledSGD([torch.nn.Parameter(torch.zeros(2, 3))], lr=0.1, scale=0.01)
    problem = optimizer_problem(opt, _plan(zero=1))
    assert problem is not None and "scale=0.01 (rebuilt: 1.0)" in problem
    assert optimizer_problem(opt, _plan(zero=0)) is None  # used as built: nothing lost
    with pytest.raises(ParcError, match=r"scale=0\.01"):
        rebuilt_like(opt, [[torch.nn.Parameter(torch.zeros(3))]])


def test_a_rebuild_passes_the_constructor_keywords_the_groups_hold() -> None:
    # A required `lr` made the rebuild raise, and the probe call the class "not elementwise".
    opt = _LrRequired([torch.nn.Parameter(torch.zeros(2, 3))], lr=0.05)
    assert locality_of(opt) is Locality.ELEMENTWISE
    new = rebuilt_like(opt, [[torch.nn.Parameter(torch.zeros(3))]])
    assert type(new) is _LrRequired and new.param_groups[0]["lr"] == 0.05
