"""`parc demo` (what `make demo` runs): train a small GPT with pipeline + tensor parallelism
on 4 CPU processes, watch the loss fall, then prove the run equivalent to one device.

The run is the common case of `parc run`: a text file (`--data`, here parc's own
source code, byte by byte) read by each rank for its own share, a warmup + cosine
learning-rate schedule, gradient clipping by the global norm, and every step's
metrics (loss, lr, grad norm, tokens/s, step time, peak memory) on the progress
line and in a JSON-lines log. Writes next to the run (default `runs/demo/`): the
spec, the corpus, the metrics log, the loss curve (`loss.svg`) and the pipeline
timeline (`timeline.svg`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from parc.errors import ParcError

__all__ = ["CLIP", "SPEC", "run_demo"]

CLIP = 1.0  # the global gradient norm the demo clips to

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
    from parc.demo_model import LR
    from parc.plots import loss_curve_svg
    from parc.runtime.check import format_check, run_check
    from parc.runtime.schedules import Schedule, ScheduleKind
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
    log = out / "metrics.jsonl"
    _train(spec, model, out, log, steps=steps, batch=batch, world=analysis.plan.mesh.world_size)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    points = [(r["step"], r["loss"]) for r in rows]
    (out / "loss.svg").write_text(
        loss_curve_svg(points, title=f"parc demo: training loss, {analysis.plan.mesh}")
    )
    _say(f"\nLoss {points[0][1]:.3f} -> {points[-1][1]:.3f} over {len(points)} steps.")
    _say(_metrics_summary(rows, log))
    _say(
        "Equivalence: the same 3 steps on one device and on the 4-process program "
        "(same seed, batches, the model's optimizer, warmup + cosine lr, clipping):\n"
    )
    schedule = Schedule(kind=ScheduleKind.COSINE, steps=3, warmup=1, min_lr=LR / 10)
    result = run_check(str(spec), model, steps=3, batch=batch, clip=CLIP, lr_schedule=schedule)
    _say(format_check(result))
    _say(
        f"Pictures: {out / 'loss.svg'}, {out / 'timeline.svg'}   "
        f"(demo took {time.perf_counter() - began:.0f} s)"
    )
    return 0 if result.ok else 1


def _train(
    spec: Path, model: str, out: Path, log: Path, *, steps: int, batch: int, world: int
) -> None:
    """`parc run` as a real job runs: the text file, warmup + cosine, clipping, a log."""
    from parc.demo_model import LR, corpus_bytes
    from parc.runtime.launch import launch

    log.unlink(missing_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_bytes(corpus_bytes())
    warmup = max(1, steps // 10)
    _say(
        f"Training {steps} steps on {world} processes (torchrun, "
        f"gloo) on {corpus} ({corpus.stat().st_size:,} bytes; each rank reads its own "
        f"share), lr: {warmup} warmup steps then cosine to a tenth, gradients clipped to "
        f"norm {CLIP:g}:"
    )
    argv = [
        "run",
        str(spec),
        model,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--data",
        str(corpus),
        "--schedule",
        "cosine",
        "--warmup",
        str(warmup),
        "--min-lr",
        f"{LR / 10:g}",
        "--clip",
        f"{CLIP:g}",
        "--log",
        str(log),
    ]
    if launch(argv, world) != 0:
        raise ParcError("the demo's training run failed; its error is printed above")


def _metrics_summary(rows: list[dict[str, Any]], log: Path) -> str:
    """What the metrics log says about the run, in three lines."""
    clipped = sum(1 for r in rows if r["grad_norm"] is not None and r["grad_norm"] > CLIP)
    last = rows[-1]
    peak = max(r["peak_memory_bytes"] for r in rows) / 2**20
    rate = sorted(r["tokens_per_s"] or 0.0 for r in rows)[len(rows) // 2]
    return (
        f"lr {rows[0]['lr']:.2g} (warmup) -> {max(r['lr'] for r in rows):.2g} -> "
        f"{last['lr']:.2g} (cosine); gradient norm {rows[0]['grad_norm']:.2f} -> "
        f"{last['grad_norm']:.2f}, clipped to {CLIP:g} on {clipped} of {len(rows)} steps;\n"
        f"median {rate:,.0f} tokens/s, peak memory {peak:,.1f} "
        f"MiB a rank ({last['peak_memory_kind'].replace('_', ' ')}); every step's metrics: {log}\n"
    )
