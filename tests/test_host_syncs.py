"""A training step waits for the device once on every rank: host syncs per step = 1.

A host sync is a read of a tensor's value on the host (`item`, `tolist`,
`float()`, `int()`, `bool()`, `__index__`, `cpu()`, `numpy()`): on a GPU each
one stalls the host until the device has caught up, so one per microbatch
serialises the pipeline's last stage. The step's one read is the Program's
global loss reduction, which carries the non-finite flag too (runtime/nonfinite.py);
the exact non-finite search adds reads only when a rank flagged its gradients.

Counted on the CPU by patching those methods of `torch.Tensor` for one step
(after a first step, so lazily built state is out of the way), every call
whichever code makes it (parc's, the model's, torch's own), with SGD, whose
step reads no tensor (AdamW reads its step counters, which torch keeps on the
CPU even under CUDA: no device sync there). On the CPU every tensor is a host
tensor, so one read is told apart by where it is made: the default loss' range
check of the targets (compiler/default_loss.py), which the Program runs once per
step on the batch as the caller gave it, before it moves to the device (a read
of host memory, no device sync, when the batch comes from the host).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import GPT, MLP

from parc.runtime.equivalence import make_optimizer, model_env

pytestmark = pytest.mark.multiprocess

# The Tensor methods that read a value on the host.
_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")

_GPT_ENV = {
    "GPT_LAYERS": "2",
    "GPT_DIM": "16",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "48",
    "GPT_SEQ": "8",
    "GPT_TIE": "1",
}


@contextlib.contextmanager
def _counting_reads(where: list[str]) -> Iterator[None]:
    """Append the caller of every host read to `where` for the duration of the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0]
            where.append(f"{name} at {caller.filename}:{caller.lineno}")
            return original(self, *args, **kwargs)

        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _split(where: list[str]) -> tuple[list[str], list[str]]:
    """(reads of the host's targets by the default loss' range check, every other read)."""
    host = [w for w in where if "default_loss.py" in w]
    return host, [w for w in where if w not in host]


def reads_in_one_step(spec_text: str, model: str, env: dict[str, str], batch: int) -> list[str]:
    """Pool case: the host reads of this rank during its second training step."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    with model_env(env):
        source = load_model(model)
        program = parc_compile(spec_text, source, batch=batch, optimizer=make_optimizer("sgd"))
        program.step(*source.batch(batch, 0))
        inputs, targets = source.batch(batch, 1)
        where: list[str] = []
        with _counting_reads(where):
            program.step(inputs, targets)
    return where


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_step_of_four_microbatches_syncs_the_host_once_per_rank(
    gloo_pool: Any, schedule: str
) -> None:
    spec = (
        "mesh pp=2\nstage wte, wpe, layers[0:1] -> 0\nstage layers[1:2], ln_f, lm_head -> 1\n"
        f"microbatches 4\nschedule {schedule}\n"
    )
    reads = gloo_pool(2).run(reads_in_one_step, spec, GPT, _GPT_ENV, 8)
    # Rank 1 runs the last stage: four losses, one device read; and one range check of
    # the step's targets (not one per microbatch).
    for rank, where in enumerate(reads):
        host, device = _split(where)
        assert len(device) == 1, f"rank {rank} read the device {len(device)} times: {device}"
        assert len(host) == rank, f"rank {rank} checked the targets {len(host)} times: {host}"


def test_a_data_parallel_step_syncs_the_host_once_per_rank(gloo_pool: Any) -> None:
    for zero in (0, 2, 3):
        spec = f"mesh dp=2\nzero {zero}\n"
        reads = gloo_pool(2).run(reads_in_one_step, spec, MLP, {}, 8)
        for rank, where in enumerate(reads):
            assert len(where) == 1, f"zero {zero}, rank {rank}: {len(where)} reads: {where}"


# ------------------------------------------------------------- the non-finite flag


@pytest.mark.parametrize(
    ("grads", "flag"),
    [
        ((torch.ones(4), torch.ones(3, dtype=torch.bfloat16)), 0.0),
        ((torch.ones(4), torch.tensor([1.0, float("nan")])), 1.0),
        ((torch.tensor([float("-inf"), 1.0]),), 1.0),
        # 16-bit norms are taken in fp32: 4 x 60000's norm overflows fp16, not the flag.
        ((torch.full((4,), 60000.0, dtype=torch.float16),), 0.0),
        # Finite values whose squares overflow fp32: a false alarm (the exact search
        # clears it).
        ((torch.full((4,), 2e19),), 1.0),
    ],
)
def test_the_nonfinite_flag_is_a_device_tensor_read_by_nobody(
    grads: tuple[torch.Tensor, ...], flag: float
) -> None:
    from parc.runtime.clip import flag_and_square_sum

    where: list[str] = []
    with _counting_reads(where):
        # Counted or not, every view is read for the flag.
        views = [(g, i % 2 == 0) for i, g in enumerate(grads)]
        got, square_sum = flag_and_square_sum(views, torch.device("cpu"))
    assert where == []
    assert (got.dtype, got.shape, float(got)) == (torch.float64, (), flag)
    expected = sum(float(g.double().square().sum()) for g, counted in views if counted)
    assert square_sum.dtype == torch.float64
    if flag == 0.0:  # the counted views' squares, summed (fp32 norms: 1e-6 relative)
        assert float(square_sum) == pytest.approx(expected, rel=1e-6)


def overflowed_gradient_sum(spec_text: str) -> dict[str, Any]:
    """Pool case: a step whose gradients are all finite but sum past fp32's range."""
    from parc.api import compile as parc_compile
    from parc.compiler.model import load_model

    source = load_model(MLP)
    program = parc_compile(spec_text, source, batch=8, optimizer=make_optimizer("sgd"))
    trained = list(program.parts.sync.optimizer_params())  # ZeRO: the flat shards
    before = [t.detach().clone() for t in trained]

    def huge(step: int) -> None:
        for _, view in program.grad_views():
            view.fill_(3e38)

    program.hooks.after_sync.append(huge)
    loss = program.step(*source.batch(8, 0))
    moved = [i for i, t in enumerate(trained) if not torch.equal(t, before[i])]
    return {"loss": loss, "skipped": program.skipped, "moved": len(moved)}


@pytest.mark.parametrize("zero", [0, 3])
def test_a_finite_gradient_sum_that_overflows_still_steps(gloo_pool: Any, zero: int) -> None:
    # The flag goes up (the sum is inf); the exact search finds no parameter on any
    # rank, so every rank steps the optimizer as one device would.
    results = gloo_pool(2).run(overflowed_gradient_sum, f"mesh dp=2\nzero {zero}\n")
    for rank, result in enumerate(results):
        assert result["skipped"] == [] and result["moved"] > 0, f"rank {rank}: {result}"
