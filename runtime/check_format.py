"""How `parc check` prints its result: the text table (`format_check`) and the JSON
(`check_json`) of a `CheckResult` (runtime/check.py, which re-exports both).

Read-only over the result: nothing here runs or judges; the bounds line names the
calibration (runtime/calibration.py) the comparison used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parc.dsl.ast import Precision

from .calibration import CALIBRATIONS, FP32_EPS

if TYPE_CHECKING:
    from .check import CheckResult

# How CheckResult.optimizer_class starts for a file without configure_optimizer.
DEFAULT = "parc's default"

__all__ = ["check_json", "format_check"]


def _describe_optimizer(result: CheckResult) -> str:
    if result.optimizer == "model" and result.optimizer_class.startswith(DEFAULT):
        return f"{result.optimizer_class} (the model file defines no configure_optimizer)"
    if result.optimizer == "model":
        return f"the model's configure_optimizer ({result.optimizer_class or '?'})"
    return f"{result.optimizer} (--optimizer)"


def _describe_precision(result: CheckResult) -> str:
    """The header's words on precision: none under fp32 (its output is unchanged)."""
    if result.precision is Precision.FP32:
        return ""
    return (
        f", precision {result.precision} (fp32 master weights, gradients reduced in "
        f"{result.reduce})"
    )


def _precision_lines(result: CheckResult) -> list[str]:
    """Under bf16: where the tolerances come from, and bf16 against fp32 on one device;
    for a model built in a lower precision, its calibration."""
    cal = result.cal
    if result.precision is Precision.FP32:
        if cal is CALIBRATIONS[Precision.FP32]:
            return []
        return [
            "  tolerances: the model's parameters are built in a lower precision than fp32 "
            f"(epsilon {cal.param_eps:.3g}), so its gradients and parameters are rounded in "
            "it: the floor is one of its ulps per element a step, and sign flips of near-zero "
            "gradients are excused as under bf16 (runtime/calibration.py, calibration_for)"
        ]
    lines = [
        f"  tolerances: {result.precision}'s calibration (runtime/calibration.py): the reference "
        f"is the same {result.precision} recipe on one device, the floor from "
        f"{result.precision}'s epsilon {cal.grad_eps:.3g} for the gradients (rounded in "
        f"{result.precision}) and "
        + (
            f"fp32's {cal.param_eps:.3g} for the parameters (fp32 masters)"
            if cal.param_eps == FP32_EPS
            else f"{cal.param_eps:.3g} for the parameters (built in a lower precision)"
        ),
    ]
    if result.gap is not None:
        g = result.gap
        lines.append(
            f"  {result.precision} vs fp32 (one device): loss at step {g.steps - 1} differs by "
            f"{g.loss:.2e} (relative), parameters after {g.steps} steps by {g.params:.2e} "
            "(relative norm); informative, not judged"
        )
    return lines


def _floors(result: CheckResult) -> str:
    """The floors as the bounds line prints them: one number when they are the same."""
    cal = result.cal
    grads, params = cal.grad_floor(), cal.param_floor(result.steps)
    if cal.grad_eps == cal.param_eps:
        return f"{params:.1e}"
    return f"({grads:.1e} for gradients, {params:.1e} for parameters)"


def format_check(result: CheckResult) -> str:
    c = result.comparison
    cal = result.cal
    lines = [
        f"parc check {result.spec} {result.model}: {result.steps} steps, batch {result.batch}, "
        f"{_describe_optimizer(result)}"
        + (f", both from the weights in {result.weights}" if result.weights else "")
        + (f", gradients clipped to global norm {result.clip:g}" if result.clip else "")
        + (f", lr schedule {result.lr_schedule}" if result.lr_schedule else "")
        + _describe_precision(result),
        "",
        f"  {'step':>4}  {'reference loss':>16}  {'parallel loss':>16}  {'rel. diff':>10}",
    ]
    for step, ref, par, rel in c.rows:
        mark = "  <-- diverges" if c.first_bad_step == step else ""
        lines.append(f"  {step:>4}  {ref:>16.8f}  {par:>16.8f}  {rel:>10.2e}{mark}")
    t = result.tolerance
    lines += [
        "",
        f"  gradients at step 0:      {_nearest(c.grad_margin)} {c.worst_grad or '-'} "
        f"(|diff| {c.max_grad_diff:.3e}, {c.grad_margin:.2g} of the bound)",
        f"  parameters after step {result.steps - 1}: {_nearest(c.param_margin)} "
        f"{c.worst_param or '-'} "
        f"(|diff| {c.max_param_diff:.3e}, {c.param_margin:.2g} of the bound)",
        f"  bounds: per tensor |parallel - reference| <= {cal.noise_mult:g} x |twin - reference| "
        f"+ {_floors(result)} x |reference|; losses: rel. diff <= "
        f"{t.loss_rtol + cal.loss_floor:g} + "
        f"{cal.noise_mult:g} x the twin's" + (" largest so far" if cal.loss_running_max else ""),
        _twin_line(result),
        *_precision_lines(result),
    ]
    if result.ok:
        lines.append("  EQUIVALENT: the parallel run trains the same model as one device")
        # What holds the layout back (a gathered activation, statistics per replica) is
        # worth reading even when it trains right.
        lines += [f"  the plan warned: {w}" for w in result.warnings]
        return "\n".join(lines) + "\n"
    lines.append("  NOT EQUIVALENT: " + "; ".join(_where(result)))
    lines += [f"  the plan warned (a likely cause): {w}" for w in result.warnings]
    return "\n".join(lines) + "\n"


def _twin_line(result: CheckResult) -> str:
    if result.twin_in_order:
        return (
            "  (twin: the reference again with every module output moved by one ulp, each "
            "batch in its order: reversed, the model's random draws (dropout) moved its "
            "loss beyond rounding, so a layout drawing other masks is NOT EQUIVALENT)"
        )
    return (
        "  (twin: the reference again, each batch in reverse sample order and every module "
        "output moved by one ulp; or the reference with every batch run in two halves, "
        "whichever is farther)"
    )


def _nearest(margin: float) -> str:
    """How the tensor of largest margin stands: a margin past 1 is past its bound."""
    return "farthest past its bound" if margin > 1 else "closest to its bound"


def _where(result: CheckResult) -> list[str]:
    c = result.comparison
    where = []
    if result.twin_loss_diff is not None:
        where.append(
            "the single-device run itself changes when its batch is reversed (step 0's loss "
            f"by {result.twin_loss_diff:.2e}, rounding moves it by ~1e-7): the model's output "
            "depends on the order of samples or on random draws (dropout), so no tolerance "
            "can tell rounding from a bug"
        )
    if c.first_bad_step is not None:
        where.append(f"the loss first diverges at step {c.first_bad_step}")
    if c.bad_grad is not None:
        where.append(f"the gradient of '{c.bad_grad}' differs at step 0")
    if c.bad_param is not None:
        where.append(f"parameter '{c.bad_param}' diverges")
    if c.bad_buffer is not None:
        where.append(f"buffer '{c.bad_buffer}' diverges")
    return where


def check_json(result: CheckResult) -> dict[str, Any]:
    c, g, cal = result.comparison, result.gap, result.cal
    return {
        "spec": result.spec,
        "model": result.model,
        "steps": result.steps,
        "batch": result.batch,
        "optimizer": result.optimizer,
        "optimizer_class": result.optimizer_class,
        "weights": result.weights,
        "clip": result.clip,
        "lr_schedule": None if result.lr_schedule is None else str(result.lr_schedule),
        "equivalent": result.ok,
        "rows": [
            {"step": s, "reference_loss": a, "parallel_loss": b, "relative_difference": r}
            for s, a, b, r in c.rows
        ],
        "max_param_diff": c.max_param_diff,
        "worst_param": c.worst_param,
        "param_margin": c.param_margin,
        "max_grad_diff": c.max_grad_diff,
        "worst_grad": c.worst_grad,
        "grad_margin": c.grad_margin,
        "first_bad_step": c.first_bad_step,
        "bad_param": c.bad_param,
        "bad_grad": c.bad_grad,
        "bad_buffer": c.bad_buffer,
        "twin_loss_diff": result.twin_loss_diff,
        "warnings": list(result.warnings),
        "tolerance": {
            "loss_rtol": result.tolerance.loss_rtol,
            "loss_floor": cal.loss_floor,
            "noise_multiple": cal.noise_mult,
            "floor": cal.param_floor(result.steps),
            "gradient_floor": cal.grad_floor(),
            "calibration": str(result.precision),
        },
        "precision": str(result.precision),
        "reduce": str(result.reduce),
        "notes": list(result.notes),
        "bf16_vs_fp32": None
        if g is None
        else {"steps": g.steps, "loss": g.loss, "params": g.params},
    }
