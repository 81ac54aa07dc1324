"""`compile_rank` is the whole compiled program of a rank, and the compiler owns it.

What a running rank executes is what `compile_rank` gives for its coordinates;
compiling (`parc compile -o`) creates no process group and no optimizer and loads
no runtime module; ZeRO-3's layout, shards and tied-weight groups are data the
runtime only consumes.

Tolerances: none for what is compiled. Graph code is compared as text, shards and
parameters bitwise: both sides cut the same seeded tensors, so any difference is a
different program. The one training run (virtual stages under ZeRO-3) uses the
Equivalence tolerances, with their reason beside it.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import GPT, ROOT, check_equivalent, parc_main, world_size

from parc.compiler.frontend import Analysis, analyse
from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
from parc.compiler.model import load_model
from parc.compiler.ops.recompute import Recomputed
from parc.compiler.passes.pipeline_split import StageGraph
from parc.compiler.rank_program import RankProgram, TiedGroup, compile_rank
from parc.compiler.rank_tied import rank_tied, tied_groups
from parc.runtime.equivalence import model_env

GPT_ENV = {"GPT_LAYERS": "2", "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "32", "GPT_SEQ": "8"}
BATCH = 8
SHARDS = "".join(
    f"shard *.{m} {k} tp\n"
    for m, k in [("attn.qkv", "col"), ("attn.proj", "row"), ("mlp.fc1", "col"), ("mlp.fc2", "row")]
)
STAGES = "stage wte, wpe, layers[0] -> 0\nstage layers[1], ln_f, lm_head -> 1\n"
# dp × tp × pp, ZeRO-3 and recompute: every rewrite compile_rank owns, tied weights across
# stages (GPT ties its embedding and LM head).
SPEC_3D = f"mesh pp=2 dp=2 tp=2\n{SHARDS}{STAGES}microbatches 2\nzero 3\nrecompute layers[*]\n"
SPEC_3D_ZERO1 = f"mesh pp=2 dp=2 tp=2\n{SHARDS}{STAGES}microbatches 2\nzero 1\n"

# Virtual stages: four stages on pp=2 (stage s on pp rank s % 2), ZeRO-3 over dp=2; the
# tied embedding / head sit on stages 0 and 3, so on both pp ranks.
VIRTUAL_ENV = {**GPT_ENV, "GPT_LAYERS": "4", "GPT_VOCAB": "48"}
VIRTUAL = (
    "mesh dp=2 pp=2\n"
    "stage wte, wpe, layers[0:1] -> 0\nstage layers[1:2] -> 1\n"
    "stage layers[2:3] -> 2\nstage layers[3:4], ln_f, lm_head -> 3\n"
    "microbatches 2\nzero 3\n"
)
# Each rank: its first stage's forwards, its second's, then the backwards deepest first.
VIRTUAL_SCHEDULE = {
    0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
    1: ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"],
}


def _codes(stages: dict[int, StageGraph]) -> dict[int, list[str]]:
    """Per stage: its graph's code and the code of each recomputed region's body."""
    out = {}
    for s, stage in stages.items():
        bodies = [m.body.code for m in stage.gm.modules() if isinstance(m, Recomputed)]
        out[s] = [stage.gm.code, *bodies]
    return out


def _analysis(spec: str, env: dict[str, str] = GPT_ENV, **options: Any) -> Analysis:
    with model_env(env):
        return analyse(spec, load_model(GPT), batch=BATCH, device="cpu", seed=0, **options)


def running_program(spec: str) -> dict[str, Any]:
    """On every rank: what the compiled program it runs holds, before any step."""
    from parc.api import compile as parc_compile

    with model_env(GPT_ENV):
        program = parc_compile(spec, load_model(GPT), batch=BATCH)
    parts = program.parts
    shards = getattr(parts.sync, "shards", [])
    return {
        "coords": dict(parts.comm.coords),
        "codes": _codes(parts.stages),
        "actions": [str(a) for a in parts.actions],
        "shards": [s.detach().clone() for s in shards],
        "params": {n: p.detach().clone() for n, p in parts.local_params.items()},
        "tied": sorted(parts.tied),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", [SPEC_3D, SPEC_3D_ZERO1], ids=["zero3-recompute", "zero1"])
def test_every_rank_runs_the_graphs_compile_rank_gives_for_its_coordinates(
    gloo_pool: Any, spec: str
) -> None:
    ranks = gloo_pool(world_size(spec)).run(running_program, spec)
    analysis = _analysis(spec)
    for rank, ran in enumerate(ranks):
        program = compile_rank(analysis, ran["coords"], bucket_elems=DEFAULT_BUCKET_ELEMS)
        assert _codes(program.stages) == ran["codes"], f"rank {rank} {ran['coords']}"
        assert [str(a) for a in program.actions] == ran["actions"], f"rank {rank}"
        assert len(program.zero3_shards) == len(ran["shards"]), f"rank {rank}"
        for i, (mine, theirs) in enumerate(zip(program.zero3_shards, ran["shards"])):
            assert torch.equal(mine.detach(), theirs), f"rank {rank}: shard of unit {i}"
        if analysis.plan.zero < 3:
            assert set(program.params) == set(ran["params"]), f"rank {rank}"
            for name, value in ran["params"].items():
                assert torch.equal(program.params[name].detach(), value), f"rank {rank}: {name}"
        assert sorted(program.tied) == ran["tied"] == ["wte.weight"], f"rank {rank}"


def test_compile_rank_leaves_the_analysis_as_it_was() -> None:
    analysis = _analysis(SPEC_3D)
    before = {n: (p, p.detach().clone()) for n, p in analysis.model.named_parameters()}
    coords = {"pp": 1, "dp": 1, "tp": 0}
    first = compile_rank(analysis, coords, bucket_elems=DEFAULT_BUCKET_ELEMS)
    again = compile_rank(analysis, coords, bucket_elems=DEFAULT_BUCKET_ELEMS)
    after = dict(analysis.model.named_parameters())
    assert set(after) == set(before)
    for name, (param, value) in before.items():
        assert after[name] is param and torch.equal(param.detach(), value), name
    assert _codes(again.stages) == _codes(first.stages)
    for a, b in zip(first.zero3_shards, again.zero3_shards, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_zero3_shards_of_every_dp_rank_make_up_the_rank_parameters() -> None:
    spec = "mesh dp=2\nzero 3\n"
    analysis = _analysis(spec)
    programs = [
        compile_rank(analysis, {"dp": d}, bucket_elems=DEFAULT_BUCKET_ELEMS) for d in range(2)
    ]
    layout = programs[0].zero3
    assert layout is not None and layout == programs[1].zero3
    full = dict(analysis.model.named_parameters())
    for i, unit in enumerate(layout.units):
        flat = torch.cat([p.zero3_shards[i].detach() for p in programs])
        assert flat.numel() == unit.padded
        for name in unit.params:
            index, off = layout.offsets[name]
            assert index == i
            n = math.prod(layout.shapes[name])
            assert torch.equal(flat[off : off + n].view(layout.shapes[name]), full[name].detach())
        assert not flat[unit.numel :].any(), "padding is zero"
    for program in programs:
        shards = {id(s) for s in program.zero3_shards}
        held = {id(p) for p in program.stages[0].gm.parameters() if id(p) in shards}
        assert held == shards, "the stage graph reads the program's shard Parameters"


def test_stages_of_one_rank_read_the_rank_shards_under_zero3() -> None:
    analysis = _analysis(VIRTUAL, VIRTUAL_ENV, schedule=VIRTUAL_SCHEDULE)
    program = compile_rank(analysis, {"dp": 1, "pp": 0}, bucket_elems=DEFAULT_BUCKET_ELEMS)
    assert sorted(program.stages) == [0, 2]
    layout = program.zero3
    assert layout is not None and len(layout.units) == len(program.zero3_shards)
    # Units are numbered over the rank: stage 0's, then stage 2's.
    assert list(layout.unit_stages) == sorted(layout.unit_stages)
    assert set(layout.unit_stages) == {0, 2}
    for s, stage in program.stages.items():
        registered = [
            stage.gm.get_parameter(f"zero3_shards.u{i}") for i in range(len(layout.units))
        ]
        assert all(a is b for a, b in zip(registered, program.zero3_shards, strict=True)), s
        gathered = {
            n.args[1]
            for n in stage.gm.graph.nodes
            if n.op == "call_function" and "gather" in n.name
        }
        mine = {i for i, u in enumerate(layout.unit_stages) if u == s}
        assert mine <= gathered, f"stage {s} gathers its own units"
    assert program.tied == frozenset({"wte.weight"})  # stage 0 here, stage 3 on pp rank 1


@pytest.mark.multiprocess
def test_virtual_stages_under_zero3_and_dp_match_single_device(gloo_pool: Any) -> None:
    # Tolerances: docs/architecture.md, Equivalence (runtime/equivalence.py): losses rtol
    # 1e-5, parameters after 3 SGD-momentum steps rtol 1e-4 / atol 1e-6; two stages on a
    # rank and flat ZeRO-3 shards only change the order the same fp32 sums are taken in.
    result, _ = check_equivalent(
        gloo_pool, VIRTUAL, GPT, env=VIRTUAL_ENV, batch=BATCH, steps=3, schedule=VIRTUAL_SCHEDULE
    )
    assert result.ok, f"{VIRTUAL}: {result.describe()}\n{result.rows}"


def test_rank_code_has_a_header_per_stage_the_rank_runs() -> None:
    from parc.compiler.codegen import rank_code

    codes = rank_code(_analysis(VIRTUAL, VIRTUAL_ENV, schedule=VIRTUAL_SCHEDULE))
    headers = [line for line in codes[3].splitlines() if line.startswith("# parc:")]
    assert headers == [
        "# parc: rank 3 (dp=1, pp=1), pipeline stage 1",
        "# parc: rank 3 (dp=1, pp=1), pipeline stage 3",
    ]
    assert codes[3].count("\ndef forward(self") == 2


def test_tied_weights_are_listed_as_groups_in_creation_order() -> None:
    plan = _analysis("mesh pp=2 dp=2\n" + STAGES).plan
    per_stage = [["wte.weight", "wpe.weight"], ["ln_f.weight", "wte.weight"]]
    # Row-major ranks (pp, dp): dp replica 0 holds stage 0 on rank 0, stage 1 on rank 2.
    assert tied_groups(plan, per_stage) == (
        TiedGroup("wte.weight", (0, 2)),
        TiedGroup("wte.weight", (1, 3)),
    )
    assert rank_tied(plan, per_stage, 1) == frozenset({"wte.weight"})


def test_a_weight_tied_across_stages_of_one_rank_needs_no_group() -> None:
    plan = _analysis("mesh pp=2\n" + STAGES).plan
    # Four stages on two ranks (stage s on rank s % 2): stages 0 and 2 share rank 0.
    virtual = dataclasses.replace(plan, stage_modules=(("a",), ("b",), ("c",), ("d",)))
    assert virtual.stage_to_rank == (0, 1, 0, 1)
    same_rank = [["w"], [], ["w"], []]
    assert tied_groups(virtual, same_rank) == ()
    assert rank_tied(virtual, same_rank, 0) == frozenset()
    across = [["w"], [], [], ["w"]]
    assert tied_groups(virtual, across) == (TiedGroup("w", (0, 1)),)
    assert rank_tied(virtual, across, 0) == rank_tied(virtual, across, 1) == frozenset({"w"})


def test_assemble_refuses_a_move_that_replaces_the_shard_parameters() -> None:
    from parc.runtime.assemble import assemble
    from parc.runtime.collectives import Comm

    analysis = _analysis("mesh dp=1\nzero 3\n")
    program: RankProgram = compile_rank(analysis, {"dp": 0}, bucket_elems=DEFAULT_BUCKET_ELEMS)
    mesh = analysis.plan.mesh
    comm = Comm({}, dict(mesh.axes), mesh.coords(0), mesh.rank_of, rank=0)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # `.to` makes new ones
    try:
        with pytest.raises(AssertionError, match="replaced their Parameters"):
            assemble(
                program,
                comm,
                source=analysis.source,
                optimizer=analysis.source.configure_optimizer,
                device=torch.device("cpu"),
            )
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def test_the_runtime_assembly_imports_no_compiler_pass() -> None:
    # It builds runtime objects from a RankProgram; every graph rewrite is the compiler's.
    tree = ast.parse((ROOT / "runtime" / "assemble.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    ]
    assert "parc.compiler.rank_program" in imported
    assert [m for m in imported if m.startswith("parc.compiler.passes")] == []


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"parc compile -o called {what}")

    return refuse


@pytest.mark.parametrize("spec", [SPEC_3D, SPEC_3D_ZERO1], ids=["zero3-recompute", "zero1"])
def test_compile_output_builds_no_process_group_and_no_optimizer(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr(dist, "init_process_group", _refuse("init_process_group"))
    monkeypatch.setattr(dist, "new_group", _refuse("new_group"))
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", _refuse("Optimizer.__init__"))
    with model_env(GPT_ENV):
        code, _ = parc_main(tmp_path, "3d.par", spec, "compile", GPT, "-o", str(tmp_path / "o"))
    assert code == 0, capsys.readouterr().err
    written = sorted(p.name for p in (tmp_path / "o").glob("rank*.py"))
    assert written == [f"rank{r}.py" for r in range(8)]
    rank5 = (tmp_path / "o" / "rank5.py").read_text()  # pp=1, dp=0, tp=1
    assert rank5.startswith("# parc: rank 5 (pp=1, dp=0, tp=1), pipeline stage 1\n")


# Writes every rank's code for a dp × tp × pp spec, then lists the runtime modules loaded.
_PROBE = """
import sys
from pathlib import Path
from parc.compiler.codegen import rank_code
from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
spec, model = sys.argv[1], sys.argv[2]
codes = rank_code(analyse(spec, load_model(model), batch=8))
assert len(codes) == 8 and all(c.startswith("# parc: rank") for c in codes.values())
print(" ".join(sorted(m for m in sys.modules if m.split(".")[:2] == ["parc", "runtime"])))
"""


def test_generating_rank_code_loads_no_runtime_module(tmp_path: Path) -> None:
    spec = tmp_path / "3d.par"
    spec.write_text(SPEC_3D)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(spec), GPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={**os.environ, **GPT_ENV},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [], f"rank code loaded the runtime: {proc.stdout.strip()}"
