"""A tampered checkpoint directory is refused by `parc run --resume`, exit 2, naming the file.

runtime/checkpoint/integrity.py seals `parc.json` (a sha256 of its own
contents) and checks every entry loading reads; runtime/checkpoint/find.py
reads only `step-<N>` directories inside the checkpoint directory and never
falls back to an older checkpoint when the newest is unusable. Each case
below is one edit someone with write access to the directory can make: a
hand edit (caught by the seal), or a forger's edit that also recomputes the
seal and the digests (caught by what the entries must say). `parc run` checks
the checkpoint before it starts any process, so these runs never train;
`load_checkpoint` (what every rank runs, and a restart) refuses the same.

The checkpoints are saved in this process (a 2-layer MLP, one AdamW step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import MLP

from parc.cli import main
from parc.compiler.model import load_model
from parc.errors import ParcError
from parc.runtime.checkpoint.find import resume_point
from parc.runtime.checkpoint.store import load_checkpoint, save_checkpoint
from parc.runtime.equivalence import make_optimizer, model_env

MLP_ENV = {"MLP_LAYERS": "2", "MLP_DIM": "8", "MLP_OUT": "3"}
SPEC = "mesh dp=1\n"
DATA = "__0_0.distcp"

Tamper = Callable[[Path, Path], None]  # (checkpoint directory, a directory outside it)


def _program() -> Any:
    from parc.api import compile as parc_compile

    with model_env(MLP_ENV):
        source = load_model(MLP)
        program = parc_compile(SPEC, source, batch=8, optimizer=make_optimizer("adamw"))
        program.step(*source.batch(8, 0))
    return program


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path]:
    """tmp_path/ckpt with step-1 and step-2 (`latest` = step-2), and tmp_path/elsewhere."""
    program = _program()
    root = tmp_path / "ckpt"
    save_checkpoint(program, root, 1)
    save_checkpoint(program, root, 2)
    (tmp_path / "elsewhere").mkdir()
    return root, tmp_path / "elsewhere"


# ------------------------------------------------------------ what a tamperer does


def _info(checkpoint: Path) -> dict[str, Any]:
    return dict(json.loads((checkpoint / "parc.json").read_text()))


def _write(checkpoint: Path, info: dict[str, Any], *, reseal: bool) -> None:
    """Write `parc.json`; with `reseal`, recompute its seal as a forger who read the docs."""
    if reseal:
        body = {k: v for k, v in info.items() if k != "seal"}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        info = {**body, "seal": hashlib.sha256(text.encode()).hexdigest()}
    (checkpoint / "parc.json").write_text(json.dumps(info))


def _digest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _set_step(value: Any, *, reseal: bool) -> Tamper:
    def tamper(root: Path, _: Path) -> None:
        info = _info(root / "step-2")
        info["step"] = value
        _write(root / "step-2", info, reseal=reseal)

    return tamper


def _delete_manifest(*, keep_latest: bool) -> Tamper:
    def tamper(root: Path, _: Path) -> None:
        (root / "step-2" / "parc.json").unlink()
        if not keep_latest:
            (root / "latest").unlink()

    return tamper


def _malformed_entry(root: Path, _: Path) -> None:
    info = _info(root / "step-2")
    info["files"][DATA] = "oops"
    _write(root / "step-2", info, reseal=True)


def _entry_with_a_path(root: Path, _: Path) -> None:
    # The manifest vouches for step-1's data file instead of its own.
    info = _info(root / "step-2")
    info["files"]["../step-1/" + DATA] = info["files"].pop(DATA)
    _write(root / "step-2", info, reseal=True)


def _latest_names(text: Callable[[Path, Path], str]) -> Tamper:
    def tamper(root: Path, outside: Path) -> None:
        shutil.copytree(root / "step-1", outside / "step-1")  # a loadable checkpoint
        (root / "latest").write_text(text(root, outside) + "\n")

    return tamper


def _step_dir_links_outside(root: Path, outside: Path) -> None:
    os.replace(root / "step-2", outside / "step-2")
    (root / "step-2").symlink_to(outside / "step-2")


def _data_file_links_outside(root: Path, outside: Path) -> None:
    os.replace(root / "step-2" / DATA, outside / DATA)
    (root / "step-2" / DATA).symlink_to(outside / DATA)


def _metadata_points_outside(root: Path, _: Path) -> None:
    # DCP's .metadata names the file each tensor is read from; a forger points it
    # at a copy outside the checkpoint and fixes every digest and the seal.
    checkpoint = root / "step-2"
    shutil.copy(checkpoint / DATA, root.parent / "outside.distcp")
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file
    metadata.storage_data = {
        index: dataclasses.replace(where, relative_path="../../outside.distcp")
        for index, where in metadata.storage_data.items()
    }
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    info = _info(checkpoint)
    info["files"][".metadata"] = _digest(checkpoint / ".metadata")
    _write(checkpoint, info, reseal=True)


# (case, tamper, what the error must say: {root} is the checkpoint directory)
CASES: list[tuple[str, Tamper, tuple[str, ...]]] = [
    (
        "step_edited_200_to_7",
        _set_step(7, reseal=False),
        ("{root}/step-2 is damaged", "its parc.json was changed after it was saved"),
    ),
    (
        "step_edited_to_negative",
        _set_step(-50, reseal=False),
        ("{root}/step-2 is damaged", "its parc.json was changed after it was saved"),
    ),
    (
        "step_edited_and_resealed",
        _set_step(7, reseal=True),
        ("{root}/step-2 is damaged", "its parc.json records step 7, but the directory is step-2"),
    ),
    (
        "negative_step_resealed",
        _set_step(-50, reseal=True),
        ("its parc.json records step -50", "a whole number"),
    ),
    (
        "manifest_deleted",
        _delete_manifest(keep_latest=True),
        ("{root}/step-2 is damaged: its parc.json is missing", "never falls back"),
    ),
    (
        "manifest_and_latest_deleted",
        _delete_manifest(keep_latest=False),
        ("{root}/step-2 is damaged: its parc.json is missing", "never falls back"),
    ),
    (
        "malformed_files_entry",
        _malformed_entry,
        ("its parc.json has a malformed entry for '__0_0.distcp'",),
    ),
    (
        "files_entry_with_a_path",
        _entry_with_a_path,
        ("its parc.json lists '../step-1/__0_0.distcp', which is not a file name",),
    ),
    (
        "latest_names_a_relative_path_outside",
        _latest_names(lambda root, out: f"../{out.name}/step-1"),
        ("{root}/latest names '../elsewhere/step-1'", "not a checkpoint inside {root}"),
    ),
    (
        "latest_names_an_absolute_path",
        _latest_names(lambda root, out: str(out / "step-1")),
        ("{root}/latest names '{out}/step-1'", "not a checkpoint inside {root}"),
    ),
    (
        "latest_names_a_missing_step",
        _latest_names(lambda root, out: "step-9"),
        ("{root}/latest names step-9, which does not exist", "never falls back"),
    ),
    (
        "step_directory_links_outside",
        _step_dir_links_outside,
        ("{root}/step-2 is a link to {out}/step-2, outside {root}",),
    ),
    (
        "data_file_links_outside",
        _data_file_links_outside,
        ("{root}/step-2 is damaged", "__0_0.distcp is a link to {out}/__0_0.distcp"),
    ),
    (
        "metadata_points_outside",
        _metadata_points_outside,
        ("{root}/step-2 is damaged", ".metadata points at '../../outside.distcp'"),
    ),
]


def _expected(fragments: tuple[str, ...], root: Path, outside: Path) -> list[str]:
    return [f.replace("{root}", str(root)).replace("{out}", str(outside)) for f in fragments]


@pytest.mark.parametrize(("case", "tamper", "says"), CASES, ids=[c[0] for c in CASES])
def test_parc_run_resume_refuses_a_tampered_checkpoint_naming_the_file(
    case: str,
    tamper: Tamper,
    says: tuple[str, ...],
    run: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, outside = run
    tamper(root, outside)
    spec = tmp_path / "one.par"
    spec.write_text(SPEC)
    for key, value in MLP_ENV.items():
        monkeypatch.setenv(key, value)
    code = main(["run", str(spec), MLP, "--steps", "5", "--checkpoint", str(root), "--resume"])
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\n{out}\n{err}"
    assert err.startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for fragment in _expected(says, root, outside):
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    # Every rank (and a restart) loads through load_checkpoint: it refuses the same.
    with pytest.raises(ParcError) as info:
        load_checkpoint(_program(), root)
    for fragment in _expected(says, root, outside):
        assert fragment in str(info.value), f"{fragment!r} not in:\n{info.value}"


def test_an_untouched_checkpoint_resumes_at_its_step(run: tuple[Path, Path]) -> None:
    root, _ = run
    point = resume_point(root)
    assert (point.path, point.step) == (root / "step-2", 2)
    assert load_checkpoint(_program(), root) == 2
    (root / "latest").write_text("step-1\n")  # `latest` may name an older step on purpose
    assert resume_point(root).step == 1
    assert load_checkpoint(_program(), root / "step-2") == 2  # one checkpoint, named directly
