"""Gradient clipping by global norm (runtime/clip.py) equals `clip_grad_norm_` on one device.

Every parallel case clips at `CLIP`, below every step's norm in the reference (asserted:
the clip binds on every step), so a wrong norm scales every update wrongly. Compared
with the single-device reference (runtime/equivalence.py, which clips with
`torch.nn.utils.clip_grad_norm_`): each step's reported norm (`Program.last_grad_norm`,
every rank the same) against the norm `clip_grad_norm_` returned, and the losses and
parameters after K steps within equivalence.py's tolerances.

Norm tolerances, measured on 2 cores (gloo) over examples/gpt.py and mlp.py at the sizes
below, seeds 0-1, 3 steps, dp=2 zero 0-3, tp=2, pp=2:
- fp32: the largest relative difference was 7.2e-8 (fp32 sums in another order);
  `NORM_RTOL` 1e-5 is the issue's bound. Counting a replicated part twice moves a norm
  by far more (dp=2 zero 0: x sqrt(2); a tied GPT embedding at pp=2: 0.4% and more).
- bf16: the gradients are bf16 values summed in another order (microbatches, dp, tp),
  so the norm moves by bf16 roundings: the largest measured was 2.0e-3 (mlp.py, dp=2 zero
  1 with 2 microbatches, and dp=2 with grad_accum 2); `BF16_NORM_RTOL` 8e-3 is 4x that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, examples, parc_main, world_size
from hypothesis import given
from hypothesis import strategies as st
from procs import MODEL, run_parc

from parc.dsl.ast import AXIS_DP, AXIS_PP, Precision
from parc.errors import ParcError
from parc.runtime.clip import NormLayout, check_max_norm
from parc.runtime.equivalence import (
    Tolerance,
    compare_runs,
    model_env,
    parallel_case,
    reference_run,
)

pytestmark = pytest.mark.timeout(240)

CLIP = 0.01  # below every reference norm here (asserted): the clip binds on every step
NORM_RTOL = 1e-5
BF16_NORM_RTOL = 8e-3
STEPS, BATCH = 3, 8
GPT_TP = (
    "shard layers[*].attn.qkv col tp\nshard layers[*].attn.proj row tp\n"
    "shard layers[*].mlp.fc1 col tp\nshard layers[*].mlp.fc2 row tp\n"
)


# ----------------------------------------------------------------- the counting rule


@given(
    dp=st.integers(1, 3),
    tp=st.integers(1, 3),
    pp=st.integers(1, 3),
    zero=st.integers(0, 3),
    sliced=st.booleans(),
    holders=st.sets(st.integers(0, 2), min_size=1),
)
@examples(40)
def test_every_part_of_a_gradient_is_counted_by_exactly_one_rank(
    dp: int, tp: int, pp: int, zero: int, sliced: bool, holders: set[int]
) -> None:
    """Over the whole mesh, the ranks that count a parameter hold its distinct parts once
    each: tp slices and ZeRO ranges are all counted, replicas (zero 0 over dp, a
    replicated parameter over tp, a tied one over its holding pp ranks) once."""
    holders = {h for h in holders if h < pp} or {0}
    counting = 0
    for d in range(dp):
        for t in range(tp):
            for p in sorted(holders):  # only the holding pp ranks have a part at all
                layout = NormLayout(
                    coords={AXIS_DP: d, "tp": t, AXIS_PP: p},
                    sharded_over_dp=zero >= 1,
                    tp_axis="tp",
                    sliced=frozenset({"w"} if sliced else ()),
                    first_holder={"w": min(holders)},
                )
                counting += layout.counts("w")
    assert counting == (dp if zero >= 1 else 1) * (tp if sliced else 1)


def test_an_axis_no_statement_uses_holds_replicas() -> None:
    layout = NormLayout({AXIS_DP: 0, "x": 1}, False, None, frozenset(), {"w": 0})
    assert not layout.counts("w")
    assert NormLayout({AXIS_DP: 0, "x": 0}, False, None, frozenset(), {"w": 0}).counts("w")


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "1.0", True])
def test_a_clip_that_is_not_a_positive_finite_number_is_refused(bad: Any) -> None:
    with pytest.raises(ParcError, match="clipping threshold"):
        check_max_norm(bad)


def test_parc_run_refuses_a_non_positive_clip(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        parc_main(tmp_path, "dp2.par", "mesh dp=2\n", "run", MLP, "--clip", "0")
    assert exit_.value.code == 2
    assert "--clip: must be a positive gradient norm, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------- against one device


@dataclass(frozen=True)
class Row:
    layout: str  # dp, tp, pp, tp-pp or 3d
    zero: int
    model: str
    precision: Precision = Precision.FP32

    def __str__(self) -> str:
        return f"{self.layout}-zero{self.zero}-{Path(self.model).stem}-{self.precision}"


# Every layout, ZeRO level and precision in CI; the rows marked `thorough` repeat a ZeRO
# level another layout has (zero 1: 3d; zero 3: tp-pp) under the thorough profile.
ROWS = (
    Row("dp", 0, GPT),
    pytest.param(Row("dp", 1, MLP), marks=pytest.mark.thorough),
    Row("dp", 2, GPT),
    pytest.param(Row("dp", 3, GPT), marks=pytest.mark.thorough),
    Row("tp", 0, GPT),
    Row("pp", 0, GPT),
    Row("3d", 1, MLP),  # world 8 on 2 cores: the fastest model
    Row("dp", 2, MLP, Precision.BF16),
    Row("tp-pp", 3, GPT, Precision.BF16),
)


def gpt_env(heads: int, tie: bool) -> dict[str, str]:
    return {
        "GPT_LAYERS": "2",
        "GPT_DIM": str(4 * heads),
        "GPT_HEADS": str(heads),
        "GPT_VOCAB": "32",
        "GPT_SEQ": "8",
        "GPT_TIE": "1" if tie else "0",
    }


@st.composite
def case(draw: st.DrawFn, row: Row) -> tuple[str, dict[str, str]]:
    """A spec of `row`'s layout (world <= 8) that trains batch 8, and model sizes."""
    pp = 2 if "pp" in row.layout or row.layout == "3d" else 1
    tp = 2 if "tp" in row.layout or row.layout == "3d" else 1
    dp = 2 if row.layout in ("dp", "3d") else 1
    axes = [f"{n}={s}" for n, s in (("pp", pp), ("dp", dp), ("tp", tp)) if s > 1]
    shards = ("shard layers[*] col tp\n" if row.model == MLP else GPT_TP) if tp > 1 else ""
    lines = [f"mesh {' '.join(axes)}\n", shards]
    micro = 2 if pp > 1 else draw(st.sampled_from([1, 2]))
    if pp > 1:
        lines.append(f"stage auto\nschedule {draw(st.sampled_from(['gpipe', '1f1b']))}\n")
    lines.append(f"microbatches {micro}\nzero {row.zero}\nprecision {row.precision}\n")
    if row.model == MLP:
        return "".join(lines), {"MLP_LAYERS": "3", "MLP_DIM": "8", "MLP_OUT": "4"}
    return "".join(lines), gpt_env(draw(st.sampled_from([2, 4])), draw(st.booleans()))


def check_clipped(pool: Any, spec: str, model: str, env: dict[str, str], seed: int) -> dict:
    """`spec` with clipping against the clipped reference: norms, losses, parameters."""
    precision = Precision.BF16 if "precision bf16" in spec else Precision.FP32
    ref = reference_run(
        model, steps=STEPS, batch=BATCH, seed=seed, env=env, clip=CLIP, precision=precision
    )
    assert min(ref["grad_norms"]) > CLIP, f"the clip does not bind: {ref['grad_norms']}"
    results = pool(world_size(spec)).run(
        parallel_case, spec, model, steps=STEPS, batch=BATCH, seed=seed, env=env, clip=CLIP
    )
    norms = {tuple(r["grad_norms"]) for r in results}
    assert len(norms) == 1, f"ranks disagree on the norm: {norms}"
    rtol = BF16_NORM_RTOL if precision is Precision.BF16 else NORM_RTOL
    for step, (got, want) in enumerate(zip(results[0]["grad_norms"], ref["grad_norms"])):
        assert math.isclose(got, want, rel_tol=rtol), f"{spec}step {step}: {got} vs {want}"
    comparison = compare_runs(ref, results[0], Tolerance.for_optimizer("sgd", STEPS, precision))
    assert comparison.ok, f"{spec}{env}: {comparison.describe()}\n{comparison.rows}"
    return ref


@pytest.mark.multiprocess
@pytest.mark.parametrize("row", ROWS, ids=str)
@examples(1)
@given(data=st.data(), seed=st.integers(0, 3))
def test_clipped_layouts_match_clip_grad_norm_on_one_device(
    gloo_pool: Any, row: Row, data: st.DataObject, seed: int
) -> None:
    spec, env = data.draw(case(row))
    check_clipped(gloo_pool, spec, row.model, env, seed)


def reads_in_a_clipped_step(spec_text: str) -> dict[str, Any]:
    """Pool case: this rank's host reads during a clipped second step of the MLP."""
    from test_host_syncs import _counting_reads

    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model
    from parc.runtime.equivalence import make_optimizer

    source = load_model(MLP)
    program = parc_compile(spec_text, source, batch=BATCH, optimizer=make_optimizer("sgd"))
    program.clip = CLIP
    program.step(*source.batch(BATCH, 0))
    where: list[str] = []
    with _counting_reads(where):
        program.step(*source.batch(BATCH, 1))
    return {"reads": where, "norm": program.last_grad_norm}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "spec", ["mesh dp=2\n", "mesh dp=2\nzero 3\n", "mesh pp=2\nstage auto\nmicrobatches 2\n"]
)
def test_a_clipped_step_still_reads_the_device_once(gloo_pool: Any, spec: str) -> None:
    # The norm travels in the loss' all-reduce and is read by its one tolist(); the
    # coefficient is a host float, so scaling the gradients reads nothing.
    for rank, seen in enumerate(gloo_pool(2).run(reads_in_a_clipped_step, spec)):
        assert seen["norm"] > CLIP, f"the clip does not bind: {seen}"
        assert len(seen["reads"]) == 1, f"rank {rank}: {seen['reads']}"


# ----------------------------------------------------------------- tied weights


def counted_on_every_holder(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Pool case: `parallel_case` with the pp rule broken, a tied weight counted by every
    pp rank holding it (the bug of torchtitan#596's kind), then the rule restored."""
    original = NormLayout.counter

    def counter(self: NormLayout, axis: str, name: str) -> int | None:
        return None if axis == AXIS_PP else original(self, axis, name)

    NormLayout.counter = counter
    try:
        return parallel_case(*args, **kwargs)
    finally:
        NormLayout.counter = original


@pytest.mark.multiprocess
def test_a_weight_tied_across_stages_is_counted_once(gloo_pool: Any) -> None:
    spec, env = "mesh pp=2\nstage auto\nmicrobatches 2\n", gpt_env(2, tie=True)
    ref = check_clipped(gloo_pool, spec, GPT, env, seed=0)
    with model_env(env):
        model = reference_model(GPT)
    tied = [n for n, p in model.named_parameters() if _aliases(model, p) > 1]
    assert tied, "the GPT must tie its embedding and LM head"
    # Counted twice, step 0's norm would be sqrt(N^2 + |g_tied|^2) (the reference's
    # gradients are clipped: divide by the coefficient).
    norm = ref["grad_norms"][0]
    coef = CLIP / (norm + 1e-6)
    extra = sum(float(ref["grads"][n].norm()) ** 2 for n in tied) / coef**2
    twice = math.sqrt(norm**2 + extra)
    assert twice / norm - 1 > 100 * NORM_RTOL, "the tied weight is too small to tell"
    broken = gloo_pool(2).run(
        counted_on_every_holder, spec, GPT, steps=1, batch=BATCH, env=env, clip=CLIP
    )
    assert math.isclose(broken[0]["grad_norms"][0], twice, rel_tol=NORM_RTOL)


def reference_model(model_file: str) -> torch.nn.Module:
    from parc.compiler.model import load_model

    return load_model(model_file).build()


def _aliases(model: torch.nn.Module, p: torch.nn.Parameter) -> int:
    return sum(q is p for _, q in model.named_parameters(remove_duplicate=False))


# ----------------------------------------------------------------- parc check and parc run

DP2 = "mesh dp=2\n"
# Appended to examples/mlp.py: every replica counts its part (no dedup over dp), so the
# norm under dp=2 zero 0 is sqrt(2) too large. Loaded on every rank of parc check's pool.
BROKEN = (
    "\nfrom parc.runtime.clip import NormLayout as _Layout\n"
    "_Layout.counter = lambda self, axis, name: None\n"
)


@pytest.mark.multiprocess
def test_parc_check_clip_passes(tmp_path: Path, capsys: Any) -> None:
    args = ("--clip", str(CLIP), "--optimizer", "sgd", "--json")
    code, _ = parc_main(tmp_path, "dp2.par", DP2, "check", MLP, *args)
    facts = json.loads(capsys.readouterr().out)
    assert code == 0 and facts["equivalent"], facts
    assert facts["clip"] == CLIP


@pytest.mark.multiprocess
def test_parc_check_clip_fails_on_a_norm_that_counts_replicas_twice(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loading the model file here (the reference) patches this process too: undone after.
    monkeypatch.setattr(NormLayout, "counter", NormLayout.counter)
    broken = tmp_path / "mlp_broken_norm.py"
    broken.write_text(Path(MLP).read_text() + BROKEN)
    code, _ = parc_main(
        tmp_path, "dp2.par", DP2, "check", str(broken), "--clip", str(CLIP), "--optimizer", "sgd"
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "NOT EQUIVALENT" in out and "gradient of" in out, out
    assert f"gradients clipped to global norm {CLIP:g}" in out


@pytest.mark.multiprocess
def test_parc_run_clips_and_logs_the_norm_of_every_step(tmp_path: Path) -> None:
    from procs import TINY

    (tmp_path / "dp2.par").write_text(DP2)
    args = ("--steps", "3", "--clip", str(CLIP), "--log", "log.jsonl")
    done = run_parc(("run", "dp2.par", MODEL, *args), tmp_path, 120.0)
    assert done.code == 0, done
    assert "grad norm" in done.err, done
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    ref = reference_run(str(MODEL), steps=3, batch=BATCH, optimizer="sgd", env=TINY, clip=CLIP)
    assert min(ref["grad_norms"]) > CLIP
    for row, norm, loss in zip(rows, ref["grad_norms"], ref["losses"], strict=True):
        assert math.isclose(row["grad_norm"], norm, rel_tol=NORM_RTOL), row
        # Clipped updates: an unclipped run's losses from step 1 on would differ.
        assert math.isclose(row["loss"], loss, rel_tol=NORM_RTOL), row
