"""parc run's metrics of every step (runtime/metrics.py): the MFU formula, the peak memory
meter, the JSON lines, TensorBoard scalars, the summary and runs/<name>/loss.svg."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import (
    MODEL,
    SCHEDULED_LR,
    SCHEDULED_MIN_LR,
    SCHEDULED_PEAK,
    SCHEDULED_STEPS,
    SCHEDULED_WARMUP,
    TINY,
    ScheduledRun,
)

from parc.cli import main
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.errors import ParcError
from parc.runtime.equivalence import model_env, reference_run
from parc.runtime.metrics import (
    MemoryKind,
    MetricsLog,
    StepMeter,
    StepMetrics,
    known_peak_tflops,
    model_flops_utilization,
)
from parc.runtime.schedules import Schedule, ScheduleKind

pytestmark = pytest.mark.timeout(240)

# The session's `parc run` (tests/procs.py, shared with test_schedules.py): its steps, the
# TFLOP/s per device given to --peak-tflops, and its lr (tests/models/mlp_sgd.py's own).
STEPS, BATCH, PEAK = SCHEDULED_STEPS, 8, SCHEDULED_PEAK
DP2 = "mesh dp=2\n"
LR = SCHEDULED_LR
# Grad norms: the dp=2 run against one process, as tests/test_clip.py measured (rtol 1e-5).
NORM_RTOL = 1e-5
FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "peak_memory_bytes",
    "peak_memory_kind",
    "mfu",
    "skipped",
}


def test_mfu_is_achieved_flops_over_the_peak_of_the_whole_mesh() -> None:
    # 6 GFLOP a sample at 100 samples/s = 0.6 TFLOP/s over 2 devices of 100 TFLOP/s each.
    assert model_flops_utilization(6e9, 100.0, 100.0, 2) == pytest.approx(0.003)
    assert model_flops_utilization(1e12, 1.0, 1.0, 1) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        model_flops_utilization(1.0, 1.0, 0.0, 1)


def test_a_cpu_has_no_known_peak() -> None:
    assert known_peak_tflops(torch.device("cpu"), mixed=True) is None


def test_the_cpu_meter_sees_the_memory_a_step_touches() -> None:
    meter = StepMeter(torch.device("cpu"))
    assert meter.kind is MemoryKind.CPU_RSS_RISE
    # A long-lived process has freed blocks glibc keeps resident (after large frees its
    # mmap threshold rises, so the next 16 MiB comes from the heap's resident pages): the
    # meter must still see the step touch them.
    freed = torch.ones(32 * 2**20, dtype=torch.uint8)  # mmapped: freeing it raises the threshold
    del freed
    freed = torch.ones(16 * 2**20, dtype=torch.uint8)  # now from the heap, kept resident
    del freed
    meter.start()
    held = torch.ones(16 * 2**20, dtype=torch.uint8)  # 16 MiB, every page written
    seconds, peak = meter.stop()
    del held
    assert seconds > 0 and peak >= 16 * 2**20, peak
    meter.start()  # the high-water mark is reset: the next step does not see the last one's
    _, again = meter.stop()
    assert again < 16 * 2**20, again


def test_without_a_resettable_mark_the_cpu_meter_reports_the_process_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("parc.runtime.metrics.os.access", lambda path, mode: False)
    meter = StepMeter(torch.device("cpu"))
    assert meter.kind is MemoryKind.CPU_PROCESS_PEAK
    meter.start()
    _, peak = meter.stop()
    assert peak > 2**20, peak  # this Python process with torch holds far more than 1 MiB


def _metrics(**changes: Any) -> StepMetrics:
    base: dict[str, Any] = dict(
        step=0, loss=1.0, lr=0.1, grad_norm=2.0, samples=8, items=8, unit="samples",
        step_time_s=0.5, peak_memory_bytes=1024, memory_kind=MemoryKind.CPU_RSS_RISE,
        mfu=None, skipped=False,
    )  # fmt: skip
    return StepMetrics(**{**base, **changes})


def test_a_json_line_has_every_field_and_nulls_what_does_not_apply() -> None:
    row = _metrics().as_json()
    assert set(row) == FIELDS
    assert row["samples_per_s"] == 16.0 and row["tokens_per_s"] is None
    tokens = _metrics(items=8 * 32, unit="tokens", grad_norm=math.inf).as_json()
    assert tokens["tokens_per_s"] == 8 * 32 / 0.5 and tokens["grad_norm"] is None
    json.dumps(tokens, allow_nan=False)


def test_tensorboard_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ParcError) as err:
        MetricsLog(None, "tb")
    assert "parc[tensorboard]" in str(err.value.hint), err.value


def test_parc_run_refuses_tensorboard_without_the_extra_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dp2.par").write_text(DP2)
    with model_env(TINY):
        code = main(["run", "dp2.par", str(MODEL), "--tensorboard", "tb"])
    err = capsys.readouterr().err
    assert code == 2 and "parc[tensorboard]" in err, err
    assert "rank" not in err, err  # said by the launcher, before torchrun started any rank


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `directory`, as tensorboard's reader reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(directory))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


FLOOR = SCHEDULED_MIN_LR / LR
SCHEDULE = Schedule(
    kind=ScheduleKind.COSINE, steps=STEPS, warmup=SCHEDULED_WARMUP, min_lr=SCHEDULED_MIN_LR
)


def _rows(run: ScheduledRun) -> list[dict[str, Any]]:
    """The shared run's JSON lines (--log), one object per step."""
    rows = [json.loads(line) for line in (run.cwd / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)), rows
    return rows


@pytest.mark.multiprocess
def test_parc_run_logs_every_metric_of_every_step(scheduled_run: ScheduledRun) -> None:
    done, rows = scheduled_run.done, _rows(scheduled_run)
    ref = reference_run(str(MODEL), steps=STEPS, batch=BATCH, env=TINY, lr_schedule=SCHEDULE)
    with model_env(TINY):
        stages = analyse(DP2, load_model(MODEL), batch=BATCH).estimate.stages
    flops = sum(c.flops_per_sample for c in stages)
    for row, norm, loss in zip(rows, ref["grad_norms"], ref["losses"], strict=True):
        assert set(row) == FIELDS, row
        assert math.isclose(row["loss"], loss, rel_tol=NORM_RTOL), row
        assert row["lr"] == pytest.approx(LR * SCHEDULE.multiplier(row["step"], FLOOR)), row
        # The logged norm is Program.last_grad_norm, which equals one device's norm.
        assert math.isclose(row["grad_norm"], norm, rel_tol=NORM_RTOL), row
        assert row["step_time_s"] > 0, row
        assert row["samples_per_s"] == pytest.approx(BATCH / row["step_time_s"]), row
        assert row["tokens_per_s"] is None  # the MLP's targets are classes, no sequence
        assert row["peak_memory_kind"] in {k.value for k in MemoryKind if k.name.startswith("CPU")}
        assert row["peak_memory_bytes"] >= 0, row
        want = flops * row["samples_per_s"] / (PEAK * 1e12 * 2)  # world 2
        assert row["mfu"] == pytest.approx(want) and row["mfu"] > 0, row
        assert row["skipped"] is False
    assert "samples/s" in done.err and "MFU" in done.err and "MiB" in done.err, done.err
    assert "mean" in done.out and "samples/s, peak memory" in done.out, done.out
    assert (scheduled_run.cwd / "runs" / "dp2" / "loss.svg").read_text().startswith("<svg")


@pytest.mark.multiprocess
def test_parc_run_writes_the_same_metrics_as_tensorboard_scalars(
    scheduled_run: ScheduledRun,
) -> None:
    if not scheduled_run.tensorboard:
        pytest.skip("the tensorboard extra is not installed")
    rows = _rows(scheduled_run)
    scalars = _scalars(scheduled_run.cwd / "tb")
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "mfu"):
        got = scalars[f"train/{key}"]
        assert [s for s, _ in got] == list(range(STEPS)), key
        # Scalars are stored as float32.
        assert [v for _, v in got] == pytest.approx([r[key] for r in rows], rel=1e-6), key
