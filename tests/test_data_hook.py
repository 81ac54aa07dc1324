"""A model file's `data(ctx)` hook: each rank loads only its share (runtime/data.py).

tests/models/data_mlp.py is the tiny MLP with a data hook over a seeded
dataset of 36 samples (4 global batches of 8 an epoch, 4 dropped) and no
sample_batch; DATA_LOG records every call of the hook and every batch it
yields. The pool cases train it twice on the same ranks: with `step` on the
whole global batches one device would see (`ModelSource.batch`, the hook
under `DataContext.whole`), and from each rank's `DataStream` with
`step_local`. The programs and the data are the same, so the losses and
parameters must be *equal*, not close: any difference is a row read twice or
missed, or a share mixed up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT

from parc.compiler.data_context import DataContext
from parc.compiler.model import load_model
from parc.errors import ModelError, ParcError
from parc.runtime.data import DataPosition, DataStream

pytestmark = pytest.mark.timeout(300)

DATA_MLP = str(ROOT / "tests" / "models" / "data_mlp.py")
ENV = {"MLP_LAYERS": "4", "MLP_DIM": "8", "MLP_OUT": "3"}
BATCH, STEPS = 8, 6  # 6 steps cross the first epoch's end (4 batches an epoch)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def global_then_local(spec: str, log: str) -> dict[str, Any]:
    """Pool case: STEPS steps with `step` on the global batches, then a fresh compile
    trained from this rank's DataStream with `step_local`; both runs' losses and
    parameters, and what this rank's hook was asked for (from DATA_LOG)."""
    from parc.api import compile as parc_compile
    from parc.dsl.ast import AXIS_DP, AXIS_PP
    from parc.runtime.equivalence import model_env
    from parc.runtime.train_loop import Feed

    with model_env(ENV):
        source = load_model(DATA_MLP)
        whole = parc_compile(spec, source, batch=BATCH)
        losses = [whole.step(*source.batch(BATCH, s)) for s in range(STEPS)]
        params = whole.state_dict()
        local = parc_compile(spec, source, batch=BATCH)
        os.environ["DATA_LOG"] = log  # the local run's calls only (not the compile's)
        try:
            feed = Feed(local, source, source.data, seed=0)
            local_losses = [feed.step(s) for s in range(STEPS)]
        finally:
            del os.environ["DATA_LOG"]
        comm = local.comm
        return {
            "losses": (losses, local_losses),
            "params": (params, local.state_dict()),
            "coords": (comm.index(AXIS_PP), comm.index(AXIS_DP)),
            "needs": (local.parts.needs_inputs, local.parts.holds_last_stage),
            "position": feed.position,
        }


LAYOUTS = [
    pytest.param("mesh dp=4\n", id="dp4"),
    pytest.param("mesh dp=4\nzero 2\n", id="dp4-zero2"),
    pytest.param("mesh dp=2 tp=2\nshard layers[0] col tp\nshard layers[1] row tp\n", id="dp2-tp2"),
    pytest.param("mesh pp=2 dp=2\nstage auto\nmicrobatches 2\n", id="pp2-dp2"),
    pytest.param("mesh pp=4\nstage auto\nmicrobatches 4\n", id="pp4"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", LAYOUTS)
def test_each_rank_loading_its_share_trains_as_the_global_batch_does(
    gloo_pool: Any, tmp_path: Path, spec: str
) -> None:
    logs = [str(tmp_path / f"rank{r}.jsonl") for r in range(4)]
    results = gloo_pool(4).run(_per_rank_log, spec, logs)
    for rank, r in enumerate(results):
        losses, local_losses = r["losses"]
        assert local_losses == losses, f"rank {rank}: {local_losses} != {losses}"
        assert r["position"] is None or r["position"] == DataPosition(1, 2 * BATCH)
    full, local = results[0]["params"]
    assert full.keys() == local.keys() and full
    for name in full:
        assert torch.equal(full[name], local[name]), name
    _check_who_loaded(results, [_records(Path(p)) for p in logs])


def _per_rank_log(spec: str, logs: list[str]) -> dict[str, Any]:
    """Pool case: `global_then_local` with this rank's own DATA_LOG file."""
    import torch.distributed as dist

    return global_then_local(spec, logs[dist.get_rank()])


def _check_who_loaded(results: list[dict[str, Any]], logs: list[list[dict[str, Any]]]) -> None:
    """A rank loads inputs only where a stage reads them and targets only with the last
    stage, and a rank needing neither never calls the hook (counted in DATA_LOG)."""
    last = max(r["coords"][0] for r in results)
    for rank, (r, log) in enumerate(zip(results, logs)):
        pp = r["coords"][0]
        calls = [e for e in log if e["event"] == "call"]
        batches = [e for e in log if e["event"] == "batch"]
        if 0 < pp < last:  # a middle stage of the MLP reads no model input
            assert r["needs"] == (False, False) and log == [], f"rank {rank}: {log[:2]}"
            continue
        assert [c["epoch"] for c in calls] == [0, 1], f"rank {rank}: once an epoch"
        assert len(batches) == STEPS, f"rank {rank}"
        assert {(b["inputs"], b["targets"]) for b in batches} == {(pp == 0, pp == last)}
        assert {b["dp"] for b in batches} == {r["coords"][1]}


@pytest.mark.multiprocess
def test_resuming_under_another_dp_size_keeps_the_global_sample_order(
    gloo_pool: Any, tmp_path: Path
) -> None:
    """Saved under dp=2 after 3 steps, resumed under dp=4 and under dp=1 (the same global
    batch of 8): each global batch holds the samples the uninterrupted dp=2 run trains,
    in the same order (the shares concatenated over dp ranks)."""
    straight = tmp_path / "straight.jsonl"
    gloo_pool(2).run(_train_saving, "mesh dp=2\n", str(straight), None, 6, None)
    saved, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    gloo_pool(2).run(_train_saving, "mesh dp=2\n", str(first), str(saved), 3, None)
    want = _global_ids(_records(straight))
    assert len(want) == 6
    for world in (4, 1):
        then = tmp_path / f"then{world}.jsonl"
        spec = f"mesh dp={world}\n"
        resumed = gloo_pool(world).run(_train_saving, spec, str(then), None, 6, str(saved))
        assert resumed[0]["start"] == 3
        got = _global_ids(_records(then))
        trained = [got[g] for g in range(3, 6)]
        assert trained == [want[g] for g in range(3, 6)], f"dp={world}"


@pytest.mark.multiprocess
def test_resuming_with_another_global_batch_continues_the_epoch_s_order(
    gloo_pool: Any, tmp_path: Path
) -> None:
    """Saved after 3 global batches of 8 (24 samples into epoch 0), resumed with global
    batches of 4: the next two hold the samples of the 8-batch run's fourth, in order
    (a batch that does not divide 24 is refused: the one-process tests)."""
    straight, saved = tmp_path / "straight.jsonl", tmp_path / "ckpt"
    gloo_pool(2).run(_train_saving, "mesh dp=2\n", str(straight), None, 4, None)
    first = str(tmp_path / "first.jsonl")
    gloo_pool(2).run(_train_saving, "mesh dp=2\n", first, str(saved), 3, None)
    then = tmp_path / "then.jsonl"
    gloo_pool(2).run(_train_saving, "mesh dp=2\n", str(then), None, 5, str(saved), 4)
    # Epoch 0 in batches of 4: 6 passed over (24 samples), then 6 and 7 trained.
    got = _global_ids(_records(then))
    assert got[6] + got[7] == _global_ids(_records(straight))[3]


def _global_ids(log: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Global batch number (epochs of 4) -> its sample ids, the dp shares in rank order;
    a batch yielded again (the skipped batches of a resume) must hold the same ids."""
    shares: dict[tuple[int, int], dict[int, list[int]]] = {}
    for e in log:
        if e["event"] == "batch":
            seen = shares.setdefault((e["epoch"], e["index"]), {})
            assert seen.get(e["dp"], e["ids"]) == e["ids"], e
            seen[e["dp"]] = e["ids"]
    return {
        epoch * 4 + index: [i for d in sorted(by_dp) for i in by_dp[d]]
        for (epoch, index), by_dp in sorted(shares.items())
    }


def _train_saving(
    spec: str, log: str, save: str | None, steps: int, resume: str | None, batch: int = BATCH
) -> dict[str, Any]:
    """Pool case: train from the data hook up to `steps`, from checkpoint `resume` when
    given (its data position restored), saving the end to `save` when given."""
    from parc.api import compile as parc_compile
    from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
    from parc.runtime.data import saved_position
    from parc.runtime.equivalence import model_env
    from parc.runtime.train_loop import Feed

    with model_env(ENV):
        source = load_model(DATA_MLP)
        program = parc_compile(spec, source, batch=batch)
        start, position = 0, None
        if resume is not None:
            start, position = load_checkpoint(program, resume), saved_position(resume)
        os.environ["DATA_LOG"] = log  # the training's calls only (not the compile's)
        try:
            feed = Feed(program, source, source.data, seed=0, position=position)
            for step in range(start, steps):
                feed.step(step)
        finally:
            del os.environ["DATA_LOG"]
        if save is not None:
            data = feed.position.to_json() if feed.position else None
            save_checkpoint(program, save, steps, data=data)
    return {"start": start}


# ----------------------------------------------------------------- one process


def test_the_shares_of_the_dp_ranks_concatenate_to_the_same_global_order() -> None:
    def global_order(dp: int, epoch: int) -> list[int]:
        shares = [
            DataContext(
                dp_rank=d, dp_size=dp, batch=8 // dp, global_batch=8, micro_batch=1, epoch=epoch
            ).sampler(36)
            for d in range(dp)
        ]
        return [i for g in range(4) for s in shares for i in s[g * (8 // dp) : (g + 1) * (8 // dp)]]

    orders = {dp: global_order(dp, 0) for dp in (1, 2, 4, 8)}
    assert len(set(map(tuple, orders.values()))) == 1
    assert len(set(orders[1])) == 32  # drop-last: 4 of the 36 are left for another epoch
    assert global_order(1, 1) != orders[1]  # each epoch its own order
    unshuffled = DataContext.whole(8).sampler(36, shuffle=False)
    assert unshuffled == list(range(32))


def _stream(hook: Any, **kwargs: Any) -> DataStream:
    ctx = DataContext(dp_rank=1, dp_size=2, batch=2, global_batch=4, micro_batch=2)
    return DataStream(hook, ctx, path="model.py", **kwargs)


def _noisy(ctx: DataContext) -> Any:
    for _ in range(3):
        yield torch.randn(ctx.batch, 3), torch.randn(ctx.batch)


def test_the_hook_draws_from_its_own_generator_and_replays_the_same() -> None:
    torch.manual_seed(123)
    training = torch.get_rng_state()
    first = _stream(_noisy).next()
    stream = _stream(_noisy)
    batches = [stream.next() for _ in range(5)]  # into the second epoch
    assert torch.equal(torch.get_rng_state(), training), "the hook moved training's generator"
    assert torch.equal(batches[0].inputs, first.inputs)
    assert [(b.epoch, b.index) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert not torch.equal(batches[3].inputs, batches[0].inputs)  # another epoch, another seed
    # Resumed 2 global batches (8 samples) into epoch 1: the batch after them is the same.
    resumed = _stream(_noisy, start=DataPosition(1, 4)).next()
    assert torch.equal(resumed.inputs, batches[4].inputs)
    assert torch.equal(torch.get_rng_state(), training)


def test_a_position_that_is_not_whole_global_batches_is_refused() -> None:
    with pytest.raises(ParcError, match="not a whole number of global batches of 4"):
        _stream(_noisy, start=DataPosition(0, 6))
    with pytest.raises(ParcError, match="yields 3 batches in epoch 0; the checkpoint was saved"):
        _stream(_noisy, start=DataPosition(0, 40))


def test_an_epoch_without_a_batch_names_the_hook() -> None:
    with pytest.raises(ModelError, match=r"data\(ctx\) yielded no batch in epoch 0"):
        _stream(lambda ctx: []).next()


def test_a_batch_of_another_shape_or_dtype_names_the_hook() -> None:
    from parc.compiler.model import BatchSignature

    signature = BatchSignature.of(torch.zeros(1, 3), torch.zeros(1))
    rows = _stream(lambda ctx: [(torch.zeros(4, 3), torch.zeros(4))], signature=signature)
    with pytest.raises(
        ModelError,
        match=r"data\(ctx\) \(epoch 0, batch 0\) returned inputs of "
        r"shape \(4, 3\); dim 0 must be the batch size 2",
    ):
        rows.next()
    wide = _stream(lambda ctx: [(torch.zeros(2, 5), torch.zeros(2))], signature=signature)
    with pytest.raises(ModelError, match=r"gave input 0 of shape \(2, 5\).*shape \(2, 3\)"):
        wide.next()
    ints = _stream(
        lambda ctx: [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))], signature=signature
    )
    with pytest.raises(ModelError, match=r"gave targets .* dtype torch.int64.*torch.float32"):
        ints.next()
    single = _stream(lambda ctx: [torch.zeros(2, 3)])
    with pytest.raises(ModelError, match="it must return a pair"):
        single.next()


def test_what_a_rank_does_not_need_is_not_read() -> None:
    ctx = DataContext(
        dp_rank=0, dp_size=1, batch=2, global_batch=2, micro_batch=2, needs_inputs=False
    )
    stream = DataStream(lambda c: [(None, torch.zeros(2))], ctx, path="model.py")
    got = stream.next()
    assert got.inputs is None and torch.equal(got.targets, torch.zeros(2))


def _model_file(tmp_path: Path, body: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(
        "import torch\n\ndef build_model():\n    return torch.nn.Linear(3, 2)\n\n" + body
    )
    return str(path)


def test_a_file_with_neither_data_nor_sample_batch_names_both(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"sample_batch\(batch_size, step\) or data\(ctx\)"):
        load_model(_model_file(tmp_path, ""))


def test_a_data_hook_parc_cannot_call_with_ctx_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"cannot be called as data\(ctx\)"):
        load_model(_model_file(tmp_path, "def data():\n    return []\n"))


def test_a_data_hook_gives_the_example_batch_the_compile_traces(tmp_path: Path) -> None:
    file = _model_file(
        tmp_path,
        "def data(ctx):\n"
        "    for i in range(2):\n"
        "        x = torch.full((ctx.batch, 3), float(i + 10 * ctx.epoch))\n"
        "        yield x, torch.zeros(ctx.batch, 2)\n",
    )
    source = load_model(file)
    assert source.sample_batch is None
    for step, value in [(0, 0.0), (1, 1.0), (2, 10.0)]:  # step 2: epoch 1's first batch
        inputs, _ = source.batch(4, step)
        assert inputs.shape == (4, 3) and float(inputs[0, 0]) == value
    bad = _model_file(
        tmp_path,
        "def data(ctx):\n    yield torch.zeros(ctx.batch + 1, 3), torch.zeros(ctx.batch, 2)\n",
        "bad.py",
    )
    with pytest.raises(ModelError, match=r"data\(ctx\) returned inputs of shape \(5, 3\)"):
        load_model(bad).batch(4, 0)


def test_a_share_that_is_not_this_ranks_size_is_a_fault_at_its_step() -> None:
    from parc.api import compile as parc_compile
    from parc.errors import RuntimeFault
    from parc.runtime.equivalence import model_env

    with model_env(ENV):
        source = load_model(DATA_MLP)
        program = parc_compile("mesh dp=1\nmicrobatches 2\n", source, batch=BATCH)
        inputs, targets = source.batch(BATCH, 0)
        with pytest.raises(RuntimeFault, match=r"input 0 has shape \(3, 8\).*\(8, 8\)") as info:
            program.step_local(inputs[:3], targets)
        assert "each rank's share must have the same shapes" in str(info.value)
        with pytest.raises(RuntimeFault, match="targets are NoneType, not a tensor"):
            program.step_local(inputs, None)  # this rank holds the last stage
        before = program.steps_done
        program.step_local(inputs, targets)
        assert program.steps_done == before + 1


def _loader(ctx: DataContext) -> Any:
    """A DataLoader over the rank's rows that shuffles them with torch's global generator
    (its sampler draws a seed from it at each `iter()`)."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    dataset = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20.0))
    rows = Subset(dataset, ctx.sampler(20, shuffle=False))
    return DataLoader(rows, batch_size=ctx.batch, shuffle=True)


def test_a_shuffling_dataloader_replays_and_leaves_training_s_generator() -> None:
    torch.manual_seed(7)
    training = torch.get_rng_state()
    stream = _stream(_loader)
    seen = [stream.next() for _ in range(7)]  # 5 global batches of 4 an epoch: into epoch 1
    assert torch.equal(torch.get_rng_state(), training)
    again = _stream(_loader)
    assert all(torch.equal(again.next().targets, s.targets) for s in seen)
    # Epoch 0 holds dp rank 1's rows (2 and 3 of each 4), each once, in the loader's order.
    epoch0 = sorted(int(t) for s in seen[:5] for t in s.targets)
    assert epoch0 == [4 * g + r for g in range(5) for r in (2, 3)]
    resumed = _stream(_loader, start=DataPosition(1, 4))  # after epoch 1's first batch
    assert torch.equal(resumed.next().targets, seen[6].targets)


def test_a_none_batch_is_refused_not_taken_for_the_end_of_the_epoch() -> None:
    with pytest.raises(ModelError, match=r"data\(ctx\) \(epoch 0, batch 0\) returned a NoneType"):
        _stream(lambda ctx: [None, (torch.zeros(2, 3), torch.zeros(2))]).next()
