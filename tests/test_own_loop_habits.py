"""Habits of a user's own training loop that parc must survive or refuse clearly (found by a
probe of `parc.compile` under torchrun): a rank-dependent `torch.manual_seed`, batches drawn
from it, and freezing part of the model after compile. Each parallel run is compared with
one device (runtime/tolerances.py: LOSS_RTOL, a few ulps of reordering over the steps)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from parc.compiler.model import load_model
from parc.runtime.equivalence import make_optimizer, model_env
from parc.runtime.same_batch import batch_fingerprint, same_batch
from parc.runtime.tolerances import LOSS_RTOL

MODEL = str(Path(__file__).parent / "models" / "module_dropout.py")  # nn.Dropout modules only
TP2 = "mesh tp=2\nshard layers[*].fc1 col tp\nshard layers[*].fc2 row tp\n"


def _compile(spec: str, p: str) -> Any:
    import parc

    with model_env({"DROP_P": p}):
        source = load_model(MODEL)
        return source, parc.compile(spec, source, batch=8, seed=0, optimizer=make_optimizer("sgd"))


# ------------------------------------------------------------------ the same global batch


def _rank_seeded_batches(spec: str, evaluate: bool) -> dict[str, Any]:
    """A loop that draws each 'global' batch from a generator seeded by its rank."""
    import torch.distributed as dist

    _, program = _compile(spec, "0")
    before = program.state_dict(rank0_only=False)
    torch.manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, 32, (8, 9))
    try:
        call = program.evaluate if evaluate else program.step
        call(tokens[:, :-1], tokens[:, 1:])
        error = None
    except Exception as exc:  # the RuntimeFault every rank raises
        error = str(exc)
    after = program.state_dict(rank0_only=False)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "steps": program.steps_done}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("spec", "evaluate"), [(TP2, False), ("mesh dp=2\n", False), (TP2, True)])
def test_ranks_given_different_global_batches_are_refused_before_the_update(
    gloo_pool: Any, spec: str, evaluate: bool
) -> None:
    # Trained silently before: each dp replica on rows of another batch, a tp group
    # combining shards of different activations.
    for rank in gloo_pool(2).run(_rank_seeded_batches, spec, evaluate):
        call = "Program.evaluate" if evaluate else "Program.step"
        assert rank["error"] is not None, "a mixed batch trained"
        assert f"the ranks were given different global batches in {call}" in rank["error"]
        assert "torch.Generator().manual_seed(step)" in rank["error"]
        assert rank["unchanged"] and rank["steps"] == 0


def test_the_fingerprints_sum_exactly_and_tell_batches_apart() -> None:
    x = torch.arange(64).reshape(8, 8)
    f = int(batch_fingerprint([x], x, world=4))
    assert f == int(batch_fingerprint([x.clone()], x.clone(), world=4))
    g = int(batch_fingerprint([x.flip(0)], x, world=4))
    assert g == int(batch_fingerprint([x.flip(0).contiguous()], x, world=4))
    assert f != g  # a collision is 1 in 2**20
    assert same_batch(4, 4.0 * f, 4.0 * f * f)
    assert not same_batch(4, 3.0 * f + g, 3.0 * f * f + g * g)
    # The largest world keeps both sums below 2**53: every term is an exact integer.
    assert int(batch_fingerprint([x], x, world=2**20)) < 2**16
    # The bits of a float batch count, not its values rounded to integers.
    y = torch.full((8, 8), 0.25)
    assert int(batch_fingerprint([y], x, world=4)) != int(batch_fingerprint([y * 1.5], x, world=4))


# ------------------------------------------------------------------ freezing after compile


def _freeze_after_compile(spec: str) -> str | None:
    source, program = _compile(spec, "0")
    program.step(*source.batch(8, 0))
    for name, p in program.parts.local_params.items():
        if name.startswith("layers.0.fc1"):
            p.requires_grad_(False)
    try:
        program.step(*source.batch(8, 1))
    except Exception as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["mesh dp=2\n", "mesh dp=2\nzero 1\n", TP2])
def test_freezing_a_parameter_after_compile_is_refused(gloo_pool: Any, spec: str) -> None:
    # Under dp and ZeRO the frozen weights went on moving (stale momentum on a zero
    # gradient): 2.4e-3 off one device after 2 steps, silently.
    for error in gloo_pool(2).run(_freeze_after_compile, spec):
        assert error is not None
        assert "parameter 'layers.0.fc1.weight' was frozen (requires_grad=False) after " in error
        assert "set requires_grad in build_model, before parc.compile" in error


def _step_without_gradients(spec: str) -> dict[str, Any]:
    source, program = _compile(spec, "0")
    errors = []
    for off in (torch.no_grad, torch.inference_mode):
        try:
            with off():
                program.step(*source.batch(8, 0))
        except Exception as exc:
            errors.append(str(exc))
    loss = program.step(*source.batch(8, 0))  # nothing was left half done
    return {"errors": errors, "loss": loss, "steps": program.steps_done}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["mesh dp=2\n", "mesh pp=2\nstage auto\nmicrobatches 2\n"])
def test_a_step_with_gradients_off_is_refused_on_every_rank(gloo_pool: Any, spec: str) -> None:
    # dp raised torch's "element 0 of tensors does not require grad"; under pp one stage
    # raised while the other waited in a receive until the group's timeout.
    ranks = gloo_pool(2).run(_step_without_gradients, spec)
    for rank in ranks:
        assert len(rank["errors"]) == 2, rank["errors"]
        for error in rank["errors"]:
            assert "Program.step was called with gradients off (inside torch.no_grad()" in error
            assert "use program.evaluate" in error
        assert rank["steps"] == 1 and math.isfinite(rank["loss"])


# ------------------------------------------------------------------ the caller's generator


def _reseeded_after_compile(steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    source, program = _compile(TP2, "0.5")
    given_back = torch.equal(torch.rand(4), expected)  # compile left the caller's stream
    torch.manual_seed(1234 + dist.get_rank())  # the user's own, rank-dependent
    losses = [program.step(*source.batch(8, s)) for s in range(steps)]
    whole = {
        n: p.detach().clone()
        for n, p in program.parts.local_params.items()
        if n not in program.parts.slices
    }
    return {"losses": losses, "whole": whole, "given_back": given_back}


def _one_device(steps: int) -> list[float]:
    with model_env({"DROP_P": "0.5"}):
        source = load_model(MODEL)
        torch.manual_seed(0)
        model = source.build()
    opt = make_optimizer("sgd")(model.parameters())
    losses = []
    for s in range(steps):
        x, y = source.batch(8, s)
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
def test_reseeding_the_global_generator_after_compile_keeps_tp_dropout_as_one_device(
    gloo_pool: Any,
) -> None:
    # A tp group drew its dropout masks from torch's global generator: a rank-dependent
    # torch.manual_seed after compile gave its ranks different masks on a replicated
    # activation, and their replicated weights drifted apart (2.8e-2 after 3 steps).
    a, b = gloo_pool(2).run(_reseeded_after_compile, 3)
    assert a["given_back"] and b["given_back"]
    assert a["whole"].keys() == b["whole"].keys() and a["whole"]
    for name, value in a["whole"].items():
        assert torch.equal(value, b["whole"][name]), name
    for got, want in zip(a["losses"], _one_device(3), strict=True):
        assert math.isclose(got, want, rel_tol=LOSS_RTOL), (a["losses"], want)


# ------------------------------------------------------------------ ranks out of step

_UNEVEN = """
import os, sys
import torch
import parc
from parc.compiler.model import load_model

source = load_model(sys.argv[1])
program = parc.compile("mesh dp=2\\n", source, batch=8, optimizer=torch.optim.SGD)
rank = int(os.environ["RANK"])
try:
    for s in range(1 + rank):  # rank 1 runs one step more than rank 0
        program.step(*source.batch(8, s))
except Exception as exc:
    with open(os.path.join(sys.argv[2], "rank" + str(rank)), "w") as out:
        out.write(type(exc).__name__ + ": " + str(exc))
parc.finish()
"""


def _torchrun_two_ranks(script_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `script_text` as a 2-rank torchrun job (argv: the model, `tmp_path`)."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    with model_env({"DROP_P": "0"}):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(script), MODEL, str(tmp_path)],
            capture_output=True, text=True, timeout=170,
            env={**env, "OMP_NUM_THREADS": "1", "DROP_P": "0"},
        )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_rank_that_runs_one_step_more_gets_an_error_naming_it_and_the_cause(
    tmp_path: Path,
) -> None:
    # gloo's bare RuntimeError before ("Read error [127.0.0.1]:7048: Connection reset by
    # peer. ... GLHF!"), naming no rank, step or likely cause.
    done = _torchrun_two_ranks(_UNEVEN, tmp_path)
    assert not (tmp_path / "rank0").exists(), (tmp_path / "rank0").read_text()
    text = (tmp_path / "rank1").read_text()
    assert text.startswith("CollectiveFailure: error: [rank 1, step 1] a collective failed: "), (
        text + done.stderr
    )
    assert "this rank was in Program.step" in text
    assert "every rank must call step, evaluate, state_dict and the checkpoint" in text


_UNEVEN_STATE = """
import os, sys
import torch
import parc
from parc.compiler.model import load_model

source = load_model(sys.argv[1])
program = parc.compile("mesh dp=2\\nzero 3\\n", source, batch=8, optimizer=torch.optim.SGD)
rank = int(os.environ["RANK"])
program.step(*source.batch(8, 0))
if rank == 1:  # rank 1 alone gathers the state; rank 0 has left
    try:
        for _ in program.iter_state():
            pass
    except Exception as exc:
        with open(os.path.join(sys.argv[2], "rank1"), "w") as out:
            out.write(type(exc).__name__ + ": " + str(exc))
parc.finish()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_rank_that_gathers_the_state_alone_gets_an_error_naming_iter_state(
    tmp_path: Path,
) -> None:
    # iter_state's gathers ran outside the Program's failure wrapper: gloo's bare
    # RuntimeError, naming no rank, step or likely cause.
    done = _torchrun_two_ranks(_UNEVEN_STATE, tmp_path)
    text = (tmp_path / "rank1").read_text()
    assert text.startswith("CollectiveFailure: error: [rank 1, step 1] a collective failed: "), (
        text + done.stderr
    )
    assert "this rank was in Program.iter_state" in text
