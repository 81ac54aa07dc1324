"""`parc run` with data per rank, end to end: real processes, as a user runs them.

Four `parc run`s: tests/models/data_mlp.py (a data(ctx) hook, no sample_batch,
noise from torch's global generator in every batch) on `mesh dp=2` for 10
steps straight, and the same run stopped after 6 (checkpoints every 3) and
resumed to 10 in fresh processes; then `--data FILE` on the tiny GPT under
`mesh pp=2` (rank 0 holds no targets), 4 steps. A resumed run is the same
program on the same ranks with the restored state and data position, so its
batches, losses and final parameters equal the uninterrupted run's *exactly*.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GPT, ROOT
from procs import TINY as ENV
from procs import Done, run_parc

from parc.runtime.equivalence import model_env
from parc.runtime.export import export_state_dict

pytestmark = pytest.mark.timeout(600)

DATA_MLP = ROOT / "tests" / "models" / "data_mlp.py"
DP2 = "mesh dp=2\n"
STEPS, STOP = 10, 6  # 36 samples, 4 global batches of 8 an epoch: 10 steps cross two epochs
TIMEOUT = 180.0  # seconds per command: a run takes ~10 s on 2 shared cores, mostly imports


def parc(*args: str | int | Path, cwd: Path) -> Done:
    done = run_parc([str(a) for a in args], cwd, TIMEOUT)
    assert done.code == 0, done
    assert "Traceback" not in done.err, done
    return done


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def training(path: Path) -> list[dict[str, Any]]:
    """The hook's records of the dp=2 training (not of the compiles' example batches)."""
    return [e for e in records(path) if e["dp_size"] == 2]


def losses(path: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in records(path)]


def batches(path: Path) -> dict[tuple[int, int, int], str]:
    """(rank, epoch, index in the epoch) -> the hash of the batch the hook yielded there;
    a batch yielded twice (a resumed run passes over the batches already trained) must
    be the same both times."""
    seen: dict[tuple[int, int, int], str] = {}
    for e in training(path):
        if e["event"] == "batch":
            key = (e["rank"], e["epoch"], e["index"])
            assert seen.setdefault(key, e["hash"]) == e["hash"], f"{key} differs when replayed"
    return seen


def final_params(cwd: Path) -> dict[str, torch.Tensor]:
    with model_env(ENV):
        out = export_state_dict(cwd / "ckpt", DATA_MLP, cwd / "model.pt")
    return torch.load(out, weights_only=True)


def test_a_stopped_and_resumed_run_sees_the_batches_of_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATA_NOISE", "1")  # the hook draws from torch's global generator
    runs = {}
    for name in ("straight", "resumed"):
        cwd = tmp_path / name
        cwd.mkdir()
        (cwd / "dp2.par").write_text(DP2)
        monkeypatch.setenv("DATA_LOG", str(cwd / "data.jsonl"))
        common = ["--log", "log.jsonl", "--checkpoint", "ckpt"]
        if name == "straight":
            parc("run", "dp2.par", DATA_MLP, "--steps", STEPS, *common, cwd=cwd)
        else:
            parc("run", "dp2.par", DATA_MLP, "--steps", STOP, "--every", 3, *common, cwd=cwd)
            info = json.loads((cwd / "ckpt" / f"step-{STOP}" / "parc.json").read_text())
            assert info["data"] == {"epoch": 1, "samples": 16}  # 6 = 4 + 2 batches of 8
            parc("run", "dp2.par", DATA_MLP, "--steps", STEPS, "--resume", *common, cwd=cwd)
        runs[name] = cwd
    straight, resumed = runs["straight"], runs["resumed"]
    assert losses(resumed / "log.jsonl") == losses(straight / "log.jsonl")
    want = batches(straight / "data.jsonl")
    assert len(want) == 2 * STEPS  # each dp rank's share of each step's batch
    assert batches(resumed / "data.jsonl") == want
    # The hook was called once an epoch, and again for the epoch the resume re-opened.
    calls = [(e["rank"], e["epoch"]) for e in training(resumed / "data.jsonl") if "index" not in e]
    assert sorted(calls) == [(r, e) for r in (0, 1) for e in (0, 1, 1, 2)]
    a, b = final_params(straight), final_params(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_data_file_trains_a_pipeline_whose_rank_0_holds_no_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_SEQ": "8"}
    for key, value in gpt.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "pp2.par").write_text("mesh pp=2\nstage auto\nmicrobatches 2\n")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    args = ["--data", "corpus.txt", "--steps", 4, "--batch", 4, "--log", "log.jsonl"]
    parc("run", "pp2.par", GPT, *args, "--checkpoint", "ckpt", cwd=tmp_path)
    rows = records(tmp_path / "log.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # Counted from the traced targets: 4 sequences of 8 tokens a step.
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(8 * r["samples_per_s"], rel=1e-9), r
    info = json.loads((tmp_path / "ckpt" / "step-4" / "parc.json").read_text())
    # 1,760 bytes are 195 windows of 9 tokens: 48 global batches an epoch.
    assert info["data"] == {"epoch": 0, "samples": 16}


def test_data_flags_are_checked_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers import parc_main

    code, _ = parc_main(tmp_path, "dp2.par", DP2, "run", str(DATA_MLP), "--tokenizer", "t")
    assert code == 2 and "--tokenizer needs --data FILE" in capsys.readouterr().err
    missing = str(tmp_path / "missing.txt")
    code, _ = parc_main(tmp_path, "dp2.par", DP2, "run", str(DATA_MLP), "--data", missing)
    assert code == 2 and f"--data {missing}: no such file" in capsys.readouterr().err


_SMALL_VOCAB = """\
import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100))


def sample_batch(batch_size, step):
    ids = torch.randint(0, 100, (batch_size, 4), generator=torch.Generator().manual_seed(step))
    return ids, ids
"""


def test_a_corpus_with_ids_the_model_cannot_take_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers import parc_main

    model = tmp_path / "small_vocab.py"
    model.write_text(_SMALL_VOCAB)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes("naïve café — ".encode() * 20)  # bytes up to 0xe2 = 226
    code, _ = parc_main(tmp_path, "dp2.par", DP2, "run", str(model), "--data", str(corpus))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "reach 226, and the model takes ids below 100" in err and "Traceback" not in err
