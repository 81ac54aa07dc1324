"""The training random stream (dropout's) is checkpointed (runtime/checkpoint/rng.py): a
resumed run draws the masks the uninterrupted run draws, on every layout.

Tolerance: none. A resumed run is the same program on the same data with the same
state, masks included, so its losses and parameters equal the uninterrupted run's
bitwise (as tests/test_checkpoint.py's resumes without dropout). Before, a resume
restarted every stream from the seed: other masks, other losses (1e-2 off at the
first step after the resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import world_size

from parc.compiler.model import ModelSource, load_model
from parc.runtime.checkpoint import store
from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
from parc.runtime.equivalence import make_optimizer, model_env

pytestmark = pytest.mark.multiprocess

MODEL = str(Path(__file__).parent / "models" / "module_dropout.py")  # nn.Dropout modules
ENV = {"DROP_P": "0.5"}  # half the elements dropped: another mask moves every loss
BATCH, STEPS, HALF = 8, 5, 2
TP = "shard layers[*].fc1 col tp\nshard layers[*].fc2 row tp\n"  # Megatron's MLP pair
PP = "stage auto\nmicrobatches 2\n"
SPECS = {
    "single": "mesh dp=1\n",
    "dp2": "mesh dp=2\n",
    "dp2-zero1": "mesh dp=2\nzero 1\n",
    "dp2-zero3": "mesh dp=2\nzero 3\n",
    "pp2": "mesh pp=2\n" + PP,
    "tp2": "mesh tp=2\n" + TP,
    "pp2-dp2": "mesh pp=2 dp=2\n" + PP,
    "dp2-tp2-zero3": "mesh dp=2 tp=2\nzero 3\n" + TP,
}


def _compile(spec: str, source: ModelSource) -> Any:
    from parc.api import compile as parc_compile

    return parc_compile(spec, source, batch=BATCH, optimizer=make_optimizer("adamw"))


def _train(program: Any, source: ModelSource, steps: range) -> list[float]:
    return [program.step(*source.batch(BATCH, step)) for step in steps]


def straight_and_resumed(spec: str, directory: str) -> dict[str, Any]:
    """5 steps straight; then 2 steps, save, a freshly compiled program, load, 3 steps."""
    with model_env(ENV):
        source = load_model(MODEL)
        straight = _train(_compile(spec, source), source, range(STEPS))
        first = _compile(spec, source)
        resumed = _train(first, source, range(HALF))
        save_checkpoint(first, directory, HALF)
        second = _compile(spec, source)
        start = load_checkpoint(second, directory)
        resumed += _train(second, source, range(start, STEPS))
        return {"straight": straight, "resumed": resumed, "stream": second.random.cpu}


@pytest.mark.parametrize("layout", list(SPECS))
def test_a_resumed_run_with_dropout_trains_as_the_uninterrupted_run(
    gloo_pool: Any, tmp_path: Path, layout: str
) -> None:
    spec = SPECS[layout]
    ranks = gloo_pool(world_size(spec)).run(straight_and_resumed, spec, str(tmp_path))
    for rank in ranks:
        assert rank["resumed"] == rank["straight"], "the masks after the resume differ"


def _save_without_stream(program: Any, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint as parc wrote it before streams were saved: no `rng.` entries."""
    with monkeypatch.context() as patched:
        patched.setattr(store, "stream_pieces", lambda program, states: [])
        save_checkpoint(program, directory, HALF)


def test_a_checkpoint_saved_without_a_stream_loads_and_keeps_the_compiled_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with model_env(ENV):
        source = load_model(MODEL)
        program = _compile(SPECS["single"], source)
        _train(program, source, range(HALF))
        _save_without_stream(program, tmp_path, monkeypatch)
        fresh = _compile(SPECS["single"], source)
        compiled = fresh.random.cpu.clone()
        assert load_checkpoint(fresh, tmp_path) == HALF
        assert torch.equal(fresh.random.cpu, compiled)
        for name, value in program.state_dict().items():  # the rest loaded as ever
            assert torch.equal(fresh.state_dict()[name], value), name


def save_dp_load_tp(directory: str) -> torch.Tensor:
    """A dp=2 checkpoint (two replicas, two streams) loaded under tp=2: each rank's stream."""
    with model_env(ENV):
        source = load_model(MODEL)
        program = _compile(SPECS["dp2"], source)
        _train(program, source, range(HALF))
        save_checkpoint(program, directory, HALF)
        loaded = _compile(SPECS["tp2"], source)
        load_checkpoint(loaded, directory)
        return loaded.random.cpu


def test_a_checkpoint_of_another_mesh_leaves_a_tp_group_one_stream(
    gloo_pool: Any, tmp_path: Path
) -> None:
    # The dp replicas' rows have the tp ranks' shape; taken, they would give a tp group
    # two streams, and its replicated weights would drift apart.
    a, b = gloo_pool(2).run(save_dp_load_tp, str(tmp_path))
    assert torch.equal(a, b)
