"""`parc demo` (what `make demo` runs): train a small GPT with pipeline + tensor parallelism
on 4 CPU processes, watch the loss fall, then prove the run equivalent to one device.

Writes next to the run (default `runs/demo/`): the spec, the loss log, the loss
curve (`loss.svg`) and the pipeline timeline (`timeline.svg`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from parc.errors import ParcError

__all__ = ["SPEC", "run_demo"]

SPEC = """\
# parc demo: a GPT on 4 processes = 2 pipeline stages x 2-way tensor parallel
mesh pp=2 tp=2
shard *.attn.qkv col tp
shard *.attn.proj row tp
shard *.mlp.fc1 col tp
shard *.mlp.fc2 row tp
stage auto
microbatches 4
schedule 1f1b
"""


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(out: Path, *, steps: int = 150, batch: int = 16) -> int:
    from parc.compiler.frontend import analyse
    from parc.compiler.report import format_report
    from parc.plots import loss_curve_svg
    from parc.runtime.check import format_check, run_check
    from parc.runtime.launch import launch
    from parc.schedule_views import schedule_grid, write_timeline

    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    spec, model = out / "demo.par", str(Path(__file__).with_name("demo_model.py"))
    spec.write_text(SPEC)
    _say("parc demo: a byte-level GPT learns to write parc's own source code.\n")
    _say(f"The spec ({spec}):\n")
    _say("    " + SPEC.replace("\n", "\n    ").rstrip())
    analysis = analyse(spec, model, batch=batch)
    _say(
        format_report(
            analysis.plan,
            analysis.estimate,
            title="What parc compiled:",
            grid=schedule_grid(analysis.plan),
        )
    )
    write_timeline(analysis.plan, out / "timeline.svg")
    log = out / "losses.jsonl"
    log.unlink(missing_ok=True)
    _say(f"Training {steps} steps on {analysis.plan.mesh.world_size} processes (torchrun, gloo):")
    argv = [
        "run",
        str(spec),
        model,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--log",
        str(log),
    ]
    if launch(argv, analysis.plan.mesh.world_size) != 0:
        raise ParcError("the demo's training run failed; its error is printed above")
    points = [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]
    (out / "loss.svg").write_text(
        loss_curve_svg(points, title=f"parc demo: training loss, {analysis.plan.mesh}")
    )
    _say(f"\nLoss {points[0][1]:.3f} -> {points[-1][1]:.3f} over {len(points)} steps.\n")
    _say(
        "Equivalence: the same 3 steps on one device and on the 4-process program "
        "(same seed, batches, the model's optimizer):\n"
    )
    result = run_check(str(spec), model, steps=3, batch=batch)
    _say(format_check(result))
    _say(
        f"Pictures: {out / 'loss.svg'}, {out / 'timeline.svg'}   "
        f"(demo took {time.perf_counter() - began:.0f} s)"
    )
    return 0 if result.ok else 1
