"""`Program.evaluate`: the global batch's mean loss in eval mode, forward only.

Compared with one device running the same weights in eval mode (`model.eval()`,
`torch.no_grad()`, the reference's own forward and loss, under bf16 its
mixed-precision recipe): before any step (the seed's weights) and after one step
(`Program.state_dict()`'s weights). Bounds: the step's loss tolerances
(runtime/tolerances.py), for the same reason: a parallel forward sums the same
products in another order (split matmuls, all-reduces, microbatch means), which
moves an fp32 loss by a few ulps (measured over these layouts at most 1.3e-7
relative, against LOSS_RTOL's 1e-5) and a bf16 one by its roundings (measured at
most 6.7e-6, dp=2 tp=2 sequence parallel zero 3; against BF16_LOSS_RTOL's 7e-4).
A loss computed with dropout on, or a microbatch or replica missing from the mean,
moves it by 1e-2 or more.

Evaluating changes nothing a step reads: a run that evaluates between its steps
trains bitwise as one that does not (losses, parameters, `comm_stats`,
`steps_done`), module dropout included (the random stream is restored), and under
ZeRO-3 no gathered unit, prefetch or handle is left behind.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import GPT, MLP, ROOT, ci_rows, gpt_env, world_size

from parc.dsl.ast import Precision
from parc.runtime.equivalence import BF16_LOSS_RTOL, LOSS_RTOL, make_optimizer, model_env

DROPOUT = str(ROOT / "tests" / "models" / "module_dropout.py")
IGNORED = str(ROOT / "tests" / "models" / "ignored_targets.py")
OWN_LOSS = str(ROOT / "tests" / "models" / "own_loss_ignored.py")
GPT_LOSS_FN = str(ROOT / "tests" / "models" / "gpt_loss_fn.py")
# BatchNorm: under dp each replica's running statistics follow its own samples; the
# model's (state_dict, export) are dp rank 0's, and evaluate must read those.
BATCHNORM = str(ROOT / "tests" / "models" / "batchnorm.py")
GPT_TP = (
    "shard *.attn.qkv col tp\nshard *.attn.proj row tp\n"
    "shard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\n"
)
GPT4_STAGES = (
    "stage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:4], ln_f, lm_head -> 3\n"
)
DROP_SP = "shard layers.*.fc1 col tp\nshard layers.*.fc2 row tp\nsequence_parallel tp\n"

# (id, model, env, spec)
LAYOUTS: dict[str, tuple[str, dict[str, str], str]] = {
    "dp": (MLP, {}, "mesh dp=2\n"),
    "dp_zero1_accum": (MLP, {}, "mesh dp=2\nzero 1\ngrad_accum 2\n"),
    "dp_zero2": (MLP, {}, "mesh dp=2\nzero 2\n"),
    "dp_zero3": (GPT, gpt_env(2, True), "mesh dp=2\nzero 3\n"),
    "tp_vocab_loss": (GPT, gpt_env(2, False), f"mesh tp=2\n{GPT_TP}shard wte vocab tp\n"
                      "shard lm_head col tp\n"),
    "tp_sp": (GPT, gpt_env(2, True), f"mesh tp=2\n{GPT_TP}sequence_parallel tp\n"),
    "pp_gpipe": (GPT, gpt_env(2, True), "mesh pp=2\nstage auto\nmicrobatches 4\nschedule gpipe\n"),
    "pp_1f1b_accum": (GPT, gpt_env(2, True),
                      "mesh pp=2\nstage auto\nmicrobatches 2\ngrad_accum 2\nschedule 1f1b\n"),
    "pp_zb1": (GPT, gpt_env(2, True), "mesh pp=2\nstage auto\nmicrobatches 4\nschedule zb1\n"),
    "pp_interleaved": (GPT, gpt_env(4, True),
                       f"mesh pp=2\n{GPT4_STAGES}microbatches 4\nschedule interleaved\n"),
    "bf16_dp_pp_zero3": (GPT, gpt_env(2, True),
                         "mesh dp=2 pp=2\nstage auto\nmicrobatches 2\nzero 3\nprecision bf16\n"),
    "3d_sp_vocab": (GPT, gpt_env(2, False),
                    f"mesh pp=2 tp=2\n{GPT_TP}sequence_parallel tp\nshard wte vocab tp\n"
                    "shard lm_head col tp\nstage auto\nmicrobatches 2\nschedule 1f1b\n"),
    "dp_tp_sp_zero3_bf16": (GPT, gpt_env(2, True),
                            f"mesh dp=2 tp=2\n{GPT_TP}sequence_parallel tp\nzero 3\n"
                            "precision bf16\n"),
    "ignored_pp_dp": (IGNORED, {}, "mesh pp=2\nstage auto\nmicrobatches 2\n"),
    "ignored_vocab_tp": (IGNORED, {}, "mesh dp=2 tp=2\nshard emb vocab tp\nshard head col tp\n"),
    "own_loss_ignored_dp_accum": (OWN_LOSS, {}, "mesh dp=2\ngrad_accum 2\n"),
    "loss_fn_pp": (GPT_LOSS_FN, gpt_env(2, True), "mesh pp=2\nstage auto\nmicrobatches 2\n"),
    "module_dropout_tp_sp": (DROPOUT, {}, f"mesh tp=2\n{DROP_SP}"),
    "module_dropout_pp_dp": (DROPOUT, {}, "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\n"),
    "batchnorm_dp": (BATCHNORM, {}, "mesh dp=2\n"),
    # compiled graphs traced in training mode, recomputed modules: eval mode switches both
    "module_dropout_compile_dp": (DROPOUT, {}, "mesh dp=2\ncompile\n"),
    "module_dropout_recompute_pp": (DROPOUT, {"DROP_P": "0.1"},  # p=0.5: the step moved
                                    # the eval loss < 1e-4 (the check below needs more)
                                    "mesh pp=2\nstage auto\nmicrobatches 2\nrecompute layers[*]\n"),
    "batchnorm_dp_pp": (BATCHNORM, {}, "mesh dp=2 pp=2\nstage auto\n"),
}  # fmt: skip
CI = {
    "dp", "dp_zero3", "tp_vocab_loss", "tp_sp", "pp_gpipe", "pp_1f1b_accum", "pp_zb1",
    "pp_interleaved", "bf16_dp_pp_zero3", "3d_sp_vocab", "ignored_pp_dp", "ignored_vocab_tp",
    "own_loss_ignored_dp_accum", "loss_fn_pp", "module_dropout_tp_sp", "module_dropout_pp_dp",
    "batchnorm_dp", "batchnorm_dp_pp", "module_dropout_compile_dp", "module_dropout_recompute_pp",
}  # fmt: skip
EVAL_STEP = 50  # the evaluated batch: sample_batch(8, 50), a batch no step trains on


def evaluate_case(spec: str, model: str, env: dict[str, str]) -> dict[str, Any]:
    """On a pool rank: evaluate the seed's weights (twice), step once, evaluate again (and
    through `evaluate_local`); the weights after the step, on rank 0."""
    import parc
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))
        x, y = source.batch(8, EVAL_STEP)
        before = [program.evaluate(x, y), program.evaluate(x, y)]
        program.step(*source.batch(8, 0))
        after = program.evaluate(x, y)
        b, dp = program.plan.batch.per_replica, program.comm.index("dp")
        cut = slice(dp * b, (dp + 1) * b)
        share = {k: v[cut] for k, v in x.items()} if isinstance(x, dict) else x[cut]
        local = program.evaluate_local(
            share if program.parts.needs_inputs else None,
            y[cut] if program.parts.holds_last_stage else None,
        )
        return {"before": before, "after": after, "local": local, "state": program.state_dict()}


def one_device_eval(
    model: str, env: dict[str, str], state: dict[str, torch.Tensor] | None, precision: Precision
) -> float:
    """The loss of sample_batch(8, EVAL_STEP) on one device in eval mode: the seed's weights,
    or `state`'s; the reference's own forward and loss (runtime/reference.py)."""
    from parc.compiler.model import load_model
    from parc.runtime.master_weights import Recipe
    from parc.runtime.reference import _reference_loss

    with model_env(env):
        source = load_model(model)
        torch.manual_seed(0)
        net = source.build()
        if state is not None:
            net.load_state_dict(state)
        recipe = Recipe.of(net, precision)
        net.eval()
        x, y = source.batch(8, EVAL_STEP)
        with torch.no_grad():
            return float(_reference_loss(source, net, recipe, x, y, EVAL_STEP))


def _close(got: float, expected: float, rtol: float) -> bool:
    return abs(got - expected) <= rtol * abs(expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ci_rows(LAYOUTS, CI))
def test_evaluate_is_the_one_device_eval_loss(gloo_pool: Any, layout: str) -> None:
    model, env, spec = LAYOUTS[layout]
    results = gloo_pool(world_size(spec)).run(evaluate_case, spec, model, env)
    precision = Precision.BF16 if "precision bf16" in spec else Precision.FP32
    rtol = BF16_LOSS_RTOL if precision is Precision.BF16 else LOSS_RTOL
    first = results[0]
    assert all(r["before"] + [r["after"], r["local"]] == first["before"] + [first["after"],
               first["local"]] for r in results), "ranks disagree"  # fmt: skip
    # Nothing random in eval mode: the same value twice; the share gives the batch's.
    assert first["before"][0] == first["before"][1]
    assert first["local"] == first["after"]
    start = one_device_eval(model, env, None, precision)
    stepped = one_device_eval(model, env, first["state"], precision)
    assert _close(first["before"][0], start, rtol), (first["before"][0], start)
    assert _close(first["after"], stepped, rtol), (first["after"], stepped)
    assert not _close(start, stepped, 1e-4)  # the step moved the weights


def trajectory_case(spec: str, model: str, env: dict[str, str], evaluate: bool) -> dict[str, Any]:
    """On a pool rank: 3 steps, evaluating before and after each when `evaluate`; the
    losses, each step's `comm_stats`, `steps_done` and (rank 0) the final weights. Under
    ZeRO-3, what the runtime holds after each evaluate (`_zero3_left`)."""
    import parc
    from parc.compiler.model import load_model
    from parc.runtime.zero3 import Zero3

    with model_env(env):
        source = load_model(model)
        program = parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))
        x, y = source.batch(8, EVAL_STEP)
        losses, stats, left, evals = [], [], [], []
        for step in range(3):
            if evaluate:
                evals.append(program.evaluate(x, y))
                if step == 0 and isinstance(program.parts.sync, Zero3):
                    # No autograd: the forward saved no unit as a handle.
                    left.append([f"saved {u}" for u in sorted(program.parts.sync._saved_units)])
            losses.append(program.step(*source.batch(8, step)))
            if evaluate:
                before = program.comm_stats()
                evals.append(program.evaluate(x, y))
                assert program.comm_stats() == before
            stats.append(program.comm_stats())
            if isinstance(program.parts.sync, Zero3):
                left.append(_zero3_left(program.parts.sync))
        return {
            "losses": losses,
            "stats": stats,
            "steps_done": program.steps_done,
            "left": left,
            "evals": evals,
            "state": program.state_dict(),
            "buffers": {k: v.clone() for k, v in program.parts.buffers.local.items()},
        }


def _zero3_left(zero3: Any) -> list[str]:
    """What a ZeRO-3 runtime holds that a forward may leave behind: prefetched or cached
    gathers, a reduce-scatter in flight, a gathered buffer still alive, units a forward
    saved as handles (only a forward with autograd saves any)."""
    held = []
    if zero3._prefetched or zero3._cache:
        held.append(f"gathers {sorted(zero3._prefetched)} {sorted(zero3._cache)}")
    if zero3._inflight is not None:
        held.append("a reduce-scatter in flight")
    alive = _alive_units(zero3)
    if alive:
        held.append(f"gathered units alive: {alive}")
    return held


def _alive_units(zero3: Any, seconds: float = 2.0) -> list[int]:
    """The units whose gathered buffer is still alive once gloo and the collector have
    let go: a finished all-gather's Work holds its output tensor until gloo's worker
    thread releases it, just after `wait` returns, so a buffer may outlive the call by a
    moment (an immediate check failed 2 of 3 runs; with this wait 0 of 16). A buffer the
    evaluation itself kept is still alive after `seconds`."""
    import gc
    import time

    deadline = time.monotonic() + seconds
    while True:
        alive = [unit for unit, ref in zero3._bases.values() if ref() is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        gc.collect()
        time.sleep(0.01)


TRAJECTORIES = {
    "dropout_pp_dp_1f1b": (DROPOUT, "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\nschedule 1f1b\n"),
    "dropout_tp_sp": (DROPOUT, f"mesh tp=2\n{DROP_SP}"),
    "dropout_dp_zero3": (DROPOUT, "mesh dp=2\nzero 3\n"),
    "dropout_pp_zero3_bf16": (
        DROPOUT, "mesh pp=2 dp=2\nstage auto\nmicrobatches 2\nzero 3\nprecision bf16\n"
    ),
    # evaluate reads dp rank 0's running statistics on every replica, then gives each its own
    "batchnorm_dp": (BATCHNORM, "mesh dp=2\n"),
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", TRAJECTORIES)
def test_a_step_after_evaluate_is_bitwise_the_step_without_it(gloo_pool: Any, layout: str) -> None:
    model, spec = TRAJECTORIES[layout]
    env = {"DROP_P": "0.5"}  # dropout on in training: the random stream matters
    pool = gloo_pool(world_size(spec))
    plain = pool.run(trajectory_case, spec, model, env, False)
    mixed = pool.run(trajectory_case, spec, model, env, True)
    for a, b in zip(plain, mixed, strict=True):
        assert a["losses"] == b["losses"]  # bitwise
        assert a["stats"] == b["stats"] and a["steps_done"] == b["steps_done"] == 3
        assert all(not held for held in b["left"]), b["left"]
        assert a["buffers"].keys() == b["buffers"].keys()
        assert all(torch.equal(v, b["buffers"][k]) for k, v in a["buffers"].items())
    for name, tensor in plain[0]["state"].items():
        assert torch.equal(tensor, mixed[0]["state"][name]), name
    # Before and after a step evaluate the same weights the same way: eval mode is
    # deterministic even with p=0.5 (each pair around an optimizer step differs).
    evals = mixed[0]["evals"]
    assert all(math.isfinite(v) for v in evals) and evals[1] == evals[2] and evals[3] == evals[4]


def refusal_case(spec: str, model: str, env: dict[str, str]) -> str:
    """On a pool rank: evaluate, expecting the refusal; its message (every rank raises)."""
    import parc
    from parc.compiler.model import load_model
    from parc.errors import RuntimeFault

    with model_env(env):
        source = load_model(model)
        program = parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))
        x, y = source.batch(8, EVAL_STEP)
        try:
            program.evaluate(x, y)
        except RuntimeFault as fault:
            loss = program.step(x, y)  # the refusal left the program able to train
            assert math.isfinite(loss)
            return str(fault)
        return "no refusal"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, env, spec",
    [
        # Only pp rank 1's stage holds the functional dropout: rank 0 refuses too.
        (DROPOUT, {"DROP_FUNCTIONAL": "1"}, "mesh pp=2\nstage auto\nmicrobatches 2\n"),
        # F.dropout(x, p, self.training) and sdpa's dropout_p, under sequence parallelism.
        (str(ROOT / "tests" / "models" / "gpt_dropout.py"), {}, f"mesh tp=2\n{DROP_SP}"),
    ],
    ids=["functional_on_one_stage", "gpt_functional_and_sdpa_sp"],
)  # fmt: skip
def test_dropout_the_trace_fixed_in_training_mode_is_refused(
    gloo_pool: Any, model: str, env: dict[str, str], spec: str
) -> None:
    messages = gloo_pool(world_size(spec)).run(refusal_case, spec, model, env)
    # The same refusal on every rank (only its "[rank N]" differs), naming the sites.
    assert len({m.split("] ", 1)[-1] for m in messages}) == 1, messages
    text = messages[0]
    assert "evaluate cannot run the model in eval mode" in text, text
    assert "dropout in 'layers.1' (p=0.5)" in text or "dropout in 'layers.0' (p=0.1)" in text, text
    assert "nn.Dropout module" in text and "self.training" in text
