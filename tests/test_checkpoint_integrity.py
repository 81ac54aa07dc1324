"""Damaged and crafted checkpoints are refused with a clear error, before anything is read.

runtime/checkpoint/integrity.py: `parc.json` records every file's size and
sha256 at save time, loading checks them first (on every rank, sharing the
work), DCP's pickled `.metadata` is unpickled through an allowlist and stored
values load with `weights_only=True`. So a truncated, edited, missing or
crafted file is a `ParcError` naming the checkpoint and the file, the program
keeps the parameters it had, and no code in a checkpoint ever runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MLP

from parc.cli import main
from parc.compiler.model import load_model
from parc.errors import ParcError
from parc.runtime.checkpoint import store as checkpoint_module
from parc.runtime.checkpoint.manifest import write_manifest
from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
from parc.runtime.equivalence import make_optimizer, model_env
from parc.runtime.export import export_state_dict
from parc.testing.pool import WorkerError

MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
BATCH = 8


def _program(spec: str = "mesh dp=1\n", optimizer: str = "adamw") -> Any:
    from parc.api import compile as parc_compile

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile(spec, source, batch=BATCH, optimizer=make_optimizer(optimizer))
        program.step(*source.batch(BATCH, 0))
    return program


def _params(program: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in program.state_dict().items()}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A one-process checkpoint after one AdamW step: tmp_path/step-1."""
    save_checkpoint(_program(), tmp_path, 1)
    return tmp_path / "step-1"


def _refused(checkpoint: Path, *says: str) -> str:
    """Loading `checkpoint` into a fresh program fails saying `says`; nothing is loaded."""
    fresh = _program()
    before = _params(fresh)
    with pytest.raises(ParcError) as info:
        load_checkpoint(fresh, checkpoint)
    text = str(info.value)
    for fragment in says:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    after = _params(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed weights"
    return text


def _rewrite_manifest(checkpoint: Path, name: str) -> None:
    """What someone who controls the whole directory can do: make the checksums (and the
    manifest's seal) match."""
    info = json.loads((checkpoint / "parc.json").read_text())
    data = (checkpoint / name).read_bytes()
    info["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(checkpoint, info)


def test_a_checkpoint_records_every_file_and_loads(saved: Path) -> None:
    info = json.loads((saved / "parc.json").read_text())
    on_disk = {p.name for p in saved.iterdir()} - {"parc.json"}
    assert set(info["files"]) == on_disk == {".metadata", "__0_0.distcp"}
    for name, entry in info["files"].items():
        data = (saved / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert load_checkpoint(_program(), saved.parent) == 1


def test_a_truncated_file_is_refused(saved: Path) -> None:
    data = saved / "__0_0.distcp"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    _refused(
        saved,
        f"checkpoint {saved} is damaged: __0_0.distcp has {size // 2} bytes; {size} were written",
        "nothing was loaded",
    )


def test_a_changed_byte_is_refused(saved: Path) -> None:
    data = bytearray((saved / "__0_0.distcp").read_bytes())
    data[-100] ^= 0x01  # one bit of a tensor: the size is unchanged
    (saved / "__0_0.distcp").write_bytes(bytes(data))
    _refused(saved, "the sha256 of __0_0.distcp differs from the one recorded at save time")


def test_changed_metadata_is_refused_before_it_is_unpickled(saved: Path) -> None:
    garbage = b"\x80\x04not a pickle at all"
    (saved / ".metadata").write_bytes(garbage)
    _refused(saved, f"is damaged: .metadata has {len(garbage)} bytes")
    _rewrite_manifest(saved, ".metadata")  # checksums that match: the unpickler still refuses
    _refused(saved, "is damaged: .metadata cannot be read")


def test_a_missing_file_is_refused(saved: Path) -> None:
    (saved / "__0_0.distcp").unlink()
    _refused(saved, "__0_0.distcp is missing")


def test_an_unreadable_or_unverifiable_parc_json_is_refused(saved: Path) -> None:
    info = json.loads((saved / "parc.json").read_text())
    (saved / "parc.json").write_text("{ not json")
    _refused(saved, "its parc.json cannot be read")
    del info["files"]
    write_manifest(saved, info)  # resealed: a seal alone is not enough
    _refused(saved, "has no checksums in its parc.json", "save it again")


def test_the_error_points_at_the_earlier_checkpoints(tmp_path: Path) -> None:
    program = _program()
    save_checkpoint(program, tmp_path, 1)
    save_checkpoint(program, tmp_path, 2)
    os.truncate(tmp_path / "step-2" / "__0_0.distcp", 10)
    text = _refused(tmp_path, f"checkpoint {tmp_path / 'step-2'} is damaged")
    assert f"(in {tmp_path}: step-1)" in text
    assert load_checkpoint(_program(), tmp_path / "step-1") == 1


class _RunsCode:
    """Unpickling this calls open(marker, "w"): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_a_crafted_metadata_pickle_never_runs(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    (saved / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _rewrite_manifest(saved, ".metadata")
    _refused(
        saved,
        ".metadata refers to 'io.open', which checkpoint metadata never holds; "
        "refusing to unpickle it",
    )
    with pytest.raises(ParcError, match="refusing to unpickle"), model_env(MLP_ENV):
        export_state_dict(saved, MLP, tmp_path / "out.pt")
    assert not marker.exists()


def test_a_crafted_value_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint written by someone else, with a pickle where the optimizer's
    # hyperparameters belong: its checksums match, as the writer computed them.
    marker = tmp_path / "code-ran"
    monkeypatch.setattr(checkpoint_module, "hyperparameters", lambda _: _RunsCode(marker))
    save_checkpoint(_program(), tmp_path / "ckpt", 1)
    monkeypatch.undo()
    _refused(tmp_path / "ckpt", "checkpoint value 'optim.param_groups' is not plain data")
    assert not marker.exists()


def test_parc_export_writes_a_file_that_loads_with_weights_only(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt"
    with model_env(MLP_ENV):
        assert main(["export", str(saved), MLP, "-o", str(out)]) == 0
        model = load_model(MLP).build()
    capsys.readouterr()
    model.load_state_dict(torch.load(out, weights_only=True))


def test_parc_export_of_a_damaged_checkpoint_exits_2(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.truncate(saved / "__0_0.distcp", 7)
    with model_env(MLP_ENV):
        code = main(["export", str(saved), MLP, "-o", str(tmp_path / "model.pt")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: checkpoint {saved} is damaged: __0_0.distcp has 7 bytes")
    assert "Traceback" not in err
    assert not (tmp_path / "model.pt").exists()


# ------------------------------------------------------------ on several ranks


def save_dp2(directory: str) -> None:
    save_checkpoint(_program("mesh dp=2\nzero 1\n"), directory, 1)


def load_dp2(directory: str) -> int:
    return int(load_checkpoint(_program("mesh dp=2\nzero 1\n"), directory))


@pytest.mark.multiprocess
def test_every_rank_refuses_a_file_only_one_rank_checked(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    pool.run(save_dp2, str(tmp_path))
    files = json.loads((tmp_path / "step-1" / "parc.json").read_text())["files"]
    assert set(files) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # each rank hashed its own
    assert pool.run(load_dp2, str(tmp_path)) == [1, 1]
    # Data files are split among the ranks for checking: __1_0 is rank 1's to check.
    os.truncate(tmp_path / "step-1" / "__1_0.distcp", 3)
    with pytest.raises(WorkerError) as info:
        pool.run(load_dp2, str(tmp_path))
    # Both ranks raised the same error: printed once, naming both (pool_failure.py).
    text = str(info.value)
    assert info.value.ranks == (0, 1), text
    assert "(raised by ranks 0, 1 of 2 of the parallel run)" in text
    assert text.count("__1_0.distcp has 3 bytes") == 1, text
