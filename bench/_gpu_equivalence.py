"""Part 1 of bench/gpu_check.py: every spec of specs/*.par at world 1, on this machine's
device, against parc's single-device reference.

A spec is reduced to world 1 by setting every axis of its `mesh` line to 1; a
statement the checker then refuses (`stage ... -> 1` needs pp > 1,
`sequence_parallel tp` needs tp > 1) is dropped: the front end's own check
(`parc.compiler.frontend.analyse`, on meta) raises a ParcError naming the spec
line, that line is blanked and the check runs again. The line numbers stay the
original file's, so each dropped statement is reported where it is written.

The reduced spec then trains as tests/helpers.py `check_equivalent` does it:
`reference_run` (the unmodified model, in this process, on the CPU as parc's
reference always runs) and `parallel_case` (the compiled program, in this
process: world 1 needs no process group, and `parc.compile` puts it on
`device_for_rank()`, cuda:0 on a GPU machine), compared by `compare_runs` with
`Tolerance.for_optimizer` at the spec's precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT
from _gpu_section import EquivalenceRow

from parc.testing.spec_models import model_for

__all__ = ["Reduced", "check_spec", "model_for", "reduce_to_world_1", "spec_files"]

OPTIMIZER = "sgd"  # tests/helpers.py's default: its parameters have teeth, unlike AdamW's


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduced:
    """A spec at world 1: its text (original line numbers) and what was dropped."""

    text: str
    dropped: tuple[str, ...]  # "specs/x.par:9 `stage ...`: why"

    def statements(self) -> str:
        """The statements kept, as parc prints them, "; "-separated."""
        from parc.dsl import parse_spec

        return "; ".join(str(parse_spec(self.text)).splitlines())


def spec_files() -> list[Path]:
    return sorted((ROOT / "specs").glob("*.par"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _refusal(text: str, name: str, model: str, env: dict[str, str]) -> Exception | None:
    """The ParcError the front end's check raises for `text` (on meta), None if it checks."""
    from parc.compiler.frontend import analyse
    from parc.dsl import parse_spec
    from parc.errors import ParcError
    from parc.runtime.equivalence import model_env

    try:
        with model_env(env):
            analyse(parse_spec(text, name), model)
    except ParcError as err:
        return err
    return None


def reduce_to_world_1(spec: Path, model: str, env: dict[str, str]) -> Reduced:
    """`spec` with every mesh axis 1 and the statements refused there dropped; raises
    RuntimeError when the checker refuses something no line of it can be dropped for."""
    from parc.dsl import parse_spec

    name = _rel(spec)
    text = spec.read_text()
    mesh = parse_spec(text, name).mesh
    lines = text.split("\n")
    if mesh.axes:
        lines[mesh.span.line - 1] = "mesh " + " ".join(f"{a.name}=1" for a in mesh.axes)
    dropped: list[tuple[int, str]] = []  # (line, words), reported in line order
    for _ in range(len(lines)):
        current = "\n".join(lines)
        err = _refusal(current, name, model, env)
        if err is None:
            return Reduced(text=current, dropped=tuple(d for _, d in sorted(dropped)))
        line = getattr(err, "line", None)
        if not line or line == mesh.span.line or not lines[line - 1].strip():
            raise RuntimeError(f"refused at world 1 with no line to drop: {_first_line(err)}")
        statement = lines[line - 1].split("#", 1)[0].strip()
        dropped.append((line, f"`{name}:{line}` `{statement}`: {getattr(err, 'message', err)}"))
        lines[line - 1] = ""  # blank, so later errors keep the file's line numbers
    raise RuntimeError(f"{name}: every statement was refused at world 1")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_spec(spec: Path, env: dict[str, str], steps: int) -> tuple[EquivalenceRow, Reduced]:
    """Reduce `spec` to world 1 and train it against the reference for `steps` steps."""
    from parc.compiler.frontend import default_batch
    from parc.dsl import parse_spec
    from parc.runtime.equivalence import (
        Tolerance,
        compare_runs,
        parallel_case,
        reference_run,
    )

    model = model_for(spec, ROOT)
    reduced = reduce_to_world_1(spec, str(model), env)
    parsed = parse_spec(reduced.text, _rel(spec))
    run: dict[str, Any] = {
        "steps": steps,
        "batch": default_batch(parsed),
        "optimizer": OPTIMIZER,
        "env": env,
    }
    ref = reference_run(str(model), **run, precision=parsed.precision)
    par = parallel_case(reduced.text, str(model), **run)
    tolerance = Tolerance.for_optimizer(OPTIMIZER, steps, parsed.precision)
    comparison = compare_runs(ref, par, tolerance)
    row = EquivalenceRow(
        spec=_rel(spec),
        model=_rel(model),
        reduced=reduced.statements(),
        ok=comparison.ok,
        worst_loss=max(r[3] for r in comparison.rows),
        loss_rtol=tolerance.loss_rtol,
        worst_param=comparison.max_param_diff,
        note="" if comparison.ok else comparison.describe(),
    )
    return row, reduced
