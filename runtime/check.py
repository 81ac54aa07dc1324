"""`parc check`: prove a spec trains the same model as one device (DESIGN.md §7).

The single-device reference runs in this process; the compiled program runs on
a local gloo world (the worker pool: forked CPU processes, no torchrun), from
the same seed, on the same batches, with the same optimizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from parc.compiler.frontend import as_spec
from parc.compiler.model import load_model

from .equivalence import Comparison, Tolerance, compare_runs, parallel_case, reference_run

__all__ = ["CheckResult", "check_json", "format_check", "run_check"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    spec: str
    model: str
    steps: int
    batch: int
    optimizer: str
    tolerance: Tolerance
    comparison: Comparison
    warnings: tuple[str, ...] = ()  # the plan's (e.g. BatchNorm under dp): likely causes

    @property
    def ok(self) -> bool:
        return self.comparison.ok


def run_check(
    spec_path: str,
    model_file: str,
    *,
    steps: int = 3,
    batch: int | None = None,
    optimizer: str = "sgd",
    seed: int = 0,
    fault: str | None = None,
    timeout: float = 300.0,
) -> CheckResult:
    """Run both sides and compare; raises ParcError for a bad spec or model."""
    from parc.compiler.frontend import analyse, default_batch
    from parc.runtime.pool import WorkerPool

    spec = as_spec(spec_path)
    source = load_model(model_file)
    batch = batch or default_batch(spec)
    # Every spec and model error, before any process starts.
    plan = analyse(spec, source, batch=batch).plan
    ref = reference_run(source.path, steps=steps, batch=batch, seed=seed, optimizer=optimizer)
    with WorkerPool(spec.mesh.world_size, timeout=timeout) as pool:
        results = pool.run(
            parallel_case,
            str(spec),
            source.path,
            steps=steps,
            batch=batch,
            seed=seed,
            optimizer=optimizer,
            fault=fault,
        )
    tol = Tolerance.for_optimizer(optimizer, steps)
    comparison = compare_runs(ref, results[0], tol)
    warnings = tuple(str(w) for w in plan.warnings)
    return CheckResult(spec_path, model_file, steps, batch, optimizer, tol, comparison, warnings)


def format_check(result: CheckResult) -> str:
    c = result.comparison
    lines = [
        f"parc check {result.spec} {result.model}: {result.steps} steps, batch {result.batch}, "
        f"{result.optimizer}",
        "",
        f"  {'step':>4}  {'reference loss':>16}  {'parallel loss':>16}  {'rel. diff':>10}",
    ]
    for step, ref, par, rel in c.rows:
        mark = "  <-- diverges" if c.first_bad_step == step else ""
        lines.append(f"  {step:>4}  {ref:>16.8f}  {par:>16.8f}  {rel:>10.2e}{mark}")
    lines.append("")
    lines.append(f"  largest parameter difference: {c.max_param_diff:.3e} ({c.worst_param or '-'})")
    t = result.tolerance
    lines.append(
        f"  tolerances: loss rtol {t.loss_rtol:g}; parameters rtol {t.param_rtol:g}, "
        f"atol {t.param_atol:g}"
    )
    if c.ok:
        lines.append("  EQUIVALENT: the parallel run trains the same model as one device")
    else:
        where = []
        if c.first_bad_step is not None:
            where.append(f"the loss first diverges at step {c.first_bad_step}")
        if c.bad_param is not None:
            where.append(f"parameter '{c.bad_param}' diverges")
        if c.bad_buffer is not None:
            where.append(f"buffer '{c.bad_buffer}' diverges")
        lines.append("  NOT EQUIVALENT: " + "; ".join(where))
        lines += [f"  the plan warned (a likely cause): {w}" for w in result.warnings]
    return "\n".join(lines) + "\n"


def check_json(result: CheckResult) -> dict[str, Any]:
    c = result.comparison
    return {
        "spec": result.spec,
        "model": result.model,
        "steps": result.steps,
        "batch": result.batch,
        "optimizer": result.optimizer,
        "equivalent": c.ok,
        "rows": [
            {"step": s, "reference_loss": a, "parallel_loss": b, "relative_difference": r}
            for s, a, b, r in c.rows
        ],
        "max_param_diff": c.max_param_diff,
        "worst_param": c.worst_param,
        "first_bad_step": c.first_bad_step,
        "bad_param": c.bad_param,
        "bad_buffer": c.bad_buffer,
        "warnings": list(result.warnings),
        "tolerance": {
            "loss_rtol": result.tolerance.loss_rtol,
            "param_rtol": result.tolerance.param_rtol,
            "param_atol": result.tolerance.param_atol,
        },
    }


def dumps(result: CheckResult) -> str:
    return json.dumps(check_json(result), indent=2)
