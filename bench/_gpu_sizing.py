"""A workload's size from a memory budget, by parc's own memory estimate.

parc's per-rank peak (`parc.compiler.loss_memory.peaks_with_loss`: the graph's
peak with the default loss's bytes, what `parc compile` and the planner price)
grows linearly in the batch and in the number of layers. It is estimated on
meta at knob values 1 and 2 (seconds, nothing allocated), the line through
them gives the largest value within the budget, and the estimate at that
value is the one reported against the measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from _common import ROOT
from _gpu_config import Workload
from _gpu_section import human

__all__ = ["Sized", "estimate_peak", "size_to_budget"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Sized:
    """A workload at the size chosen for a budget."""

    env: dict[str, str]
    batch: int
    value: int  # the knob's value
    estimate: int  # parc's per-rank peak at this size, bytes
    params: int  # parameters (a tied weight once)
    words: str  # how the size was chosen


def _analysis(spec: str, model_file: str, env: dict[str, str], batch: int) -> Any:
    from parc.compiler.frontend import analyse
    from parc.runtime.equivalence import model_env

    with model_env(env):
        return analyse(spec, model_file, batch=batch)


def estimate_peak(spec: str, model_file: str, env: dict[str, str], batch: int) -> tuple[int, int]:
    """parc's per-rank peak estimate for `spec` (one rank) on the model at `env` and
    `batch`, with its parameter count. On meta: the front end only, as `parc compile`."""
    from parc.compiler.loss_memory import peaks_with_loss

    analysis = _analysis(spec, model_file, env, batch)
    peak = max(peaks_with_loss(analysis.estimate, analysis.plan))
    return peak, sum(p.numel() for p in analysis.model.parameters())


def _parts(spec: str, model_file: str, env: dict[str, str], batch: int) -> tuple[int, int]:
    """The two sides of a one-rank run's peak (each linear in batch and layers; the peak is
    the larger): during a step with the default loss's bytes, and at the optimizer step."""
    analysis = _analysis(spec, model_file, env, batch)
    est = analysis.estimate
    # peaks_with_loss (compiler/loss_memory.py) gives only the larger of the two.
    loss = est.loss.at_peak(est.in_flight[-1] if est.in_flight else 1) if est.loss else 0
    (rank,) = est.memory
    return rank.activation_peak + loss, rank.step_peak


def _largest(at_1: int, at_2: int, budget: int, limit: int) -> int:
    """The largest v in 1..limit with at_1 + (at_2 - at_1)(v - 1) <= budget (1 if none)."""
    slope = at_2 - at_1
    if slope <= 0:
        return limit if at_1 <= budget else 1
    return max(1, min(limit, 1 + (budget - at_1) // slope))


def size_to_budget(work: Workload, spec: str, budget: int) -> Sized:
    """The largest knob value (1 to `work.limit`) whose estimated peak fits `budget`."""
    path = str(ROOT / work.model_file)
    one, two = _parts(spec, path, *work.at(1)), _parts(spec, path, *work.at(2))
    value = min(_largest(a, b, budget, work.limit) for a, b in zip(one, two))
    env, batch = work.at(value)
    estimate, params = estimate_peak(spec, path, env, batch)
    capped = f", capped at {work.limit}" if value == work.limit else ""
    words = (
        f"{work.knob} {value}: the largest whose estimate fits the budget of "
        f"{human(budget)}{capped} (estimated on meta at {work.knob} 1 and 2, "
        f"extrapolated linearly); batch {batch} × {work.seq} tokens; "
        f"`{' '.join(f'{k}={v}' for k, v in env.items())}`"
    )
    return Sized(env=env, batch=batch, value=value, estimate=estimate, params=params, words=words)
