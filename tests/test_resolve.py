"""resolve: a spec that parses but does not fit the model is a PlanError at its spec line.

The table below is the catalogue of plan-level mistakes of docs/architecture.md, Language: every
spec in it parses, and resolving it against an example model must fail with a
`PlanError` at an exact `line:col`, quoting that line with a caret, and naming
the numbers and the model names involved. The positive tests pin what valid
specs mean: shards, stage modules, batch arithmetic and warnings.

Models are traced once per module, small, on the `meta` device.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.plan import Plan, PlanWarning
from parc.compiler.report import format_report, stage_lines
from parc.compiler.resolve import resolve
from parc.compiler.trace import propagate_shapes, trace_model
from parc.dsl import ShardKind, parse_spec
from parc.errors import PlanError

EXAMPLES = Path(__file__).parent.parent / "examples"
SPEC_FILE = "bad.par"


def _gpt_line(code: str) -> str:
    """`gpt.py:N` of the line of examples/gpt.py holding `code`, as errors quote it."""
    lines = (EXAMPLES / "gpt.py").read_text().splitlines()
    return f"gpt.py:{next(i for i, line in enumerate(lines, 1) if code in line)}"


# 4 blocks so that stage ranges have room; widths small so tracing is fast.
GPT_ENV = {"GPT_LAYERS": "4", "GPT_DIM": "32", "GPT_HEADS": "2", "GPT_VOCAB": "64", "GPT_SEQ": "8"}
MLP_ENV = {"MLP_LAYERS": "8", "MLP_DIM": "16", "MLP_OUT": "4"}
# One Linear + ReLU + head: only two places to cut it (after layers.0, after acts.0).
SHALLOW_MLP_ENV = {"MLP_LAYERS": "1", "MLP_DIM": "16", "MLP_OUT": "4"}


@dataclass(frozen=True)
class Traced:
    model: torch.nn.Module
    gm: torch.fx.GraphModule


def _trace(example: str, env: dict[str, str]) -> Traced:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        source = load_model(EXAMPLES / f"{example}.py")
        model = source.build(device="meta")
        gm = trace_model(model)
        inputs, _ = source.batch(2, 0)
        propagate_shapes(gm, (inputs,))
    return Traced(model, gm)


@pytest.fixture(scope="module")
def models() -> dict[str, Traced]:
    return {
        "gpt": _trace("gpt", GPT_ENV),
        "mlp": _trace("mlp", MLP_ENV),
        "shallow_mlp": _trace("mlp", SHALLOW_MLP_ENV),
    }


def _spec_text(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


def plan_for(models: dict[str, Traced], model: str, text: str, *, batch: int = 8) -> Plan:
    spec = parse_spec(_spec_text(text), filename=SPEC_FILE)
    traced = models[model]
    return resolve(spec, traced.model, traced.gm, batch=batch)


# ---------------------------------------------------------------- invalid specs


@dataclass(frozen=True)
class BadSpec:
    """A spec that parses but must not resolve: where the error points, and what it says."""

    id: str
    model: str
    text: str
    where: str  # "line:col" of the caret
    says: tuple[str, ...]  # fragments str(err) must contain: numbers, names, the fix
    batch: int = 8


BAD_SPECS = [
    # --- divisibility of the split dim by the axis size
    BadSpec(
        "col_linear_out_features_not_divisible",
        "gpt",
        """
        mesh tp=3
        shard *.mlp.fc1 col tp
        """,
        "2:7",
        ("'layers.0.mlp.fc1'", "out_features=128", "tp=3", "not divisible"),
    ),
    BadSpec(
        "row_linear_in_features_not_divisible",
        "gpt",
        """
        mesh tp=3
        shard *.mlp.fc2 row tp
        """,
        "2:7",
        ("'layers.0.mlp.fc2'", "in_features=128", "tp=3"),
    ),
    BadSpec(
        "col_embedding_dim_not_divisible",
        "gpt",
        """
        mesh tp=3
        shard wte col tp
        """,
        "2:7",
        ("'wte'", "embedding_dim=32", "tp=3"),
    ),
    BadSpec(
        "fused_qkv_not_divisible_by_a_freely_named_axis",
        "gpt",
        """
        mesh mp=5
        shard *.attn.qkv col mp
        """,
        "2:7",
        ("'layers.0.attn.qkv'", "out_features=96", "mp=5", "a mp size that divides 96"),
    ),
    # --- the batch: global = micro × microbatches × grad_accum × dp
    BadSpec(
        "batch_not_divisible_by_dp",
        "gpt",
        """
        mesh dp=3
        """,
        "1:1",
        ("global batch 8", "dp 3", "= 3", "--batch 9"),
    ),
    BadSpec(
        "batch_not_divisible_by_dp_times_grad_accum",
        "gpt",
        """
        mesh dp=2
        grad_accum 3
        """,
        "2:1",
        ("global batch 8", "dp 2", "grad_accum 3", "= 6", "--batch 12"),
    ),
    BadSpec(
        "batch_not_divisible_by_dp_times_grad_accum_times_microbatches",
        "gpt",
        """
        mesh pp=2 dp=2
        stage layers[0:2] -> 0
        stage layers[2:4] -> 1
        microbatches 3
        grad_accum 2
        """,
        "4:1",
        ("global batch 30", "dp 2", "grad_accum 2", "microbatches 3", "= 12", "--batch 36"),
        batch=30,
    ),
    BadSpec(
        "batch_smaller_than_one_sample_per_microbatch",
        "gpt",
        """
        mesh dp=2
        microbatches 8
        """,
        "2:1",
        ("global batch 8", "microbatches 8", "= 16", "--batch 16"),
    ),
    # --- stages
    BadSpec(
        "stage_ranges_overlap",
        "gpt",
        """
        mesh pp=2
        stage layers[0:2] -> 0
        stage layers[1:4] -> 1
        """,
        "3:7",
        ("'layers.1'", "stage 1", "stage 0", "line 2", "overlap"),
    ),
    BadSpec(
        "stage_names_a_child_of_a_module_in_another_stage",
        "gpt",
        """
        mesh pp=2
        stage layers[0:2] -> 0
        stage layers.1.mlp, layers[2:4] -> 1
        """,
        "3:7",
        ("'layers.1.mlp'", "'layers.1'", "stage 0", "overlap"),
    ),
    BadSpec(
        "stage_ranges_leave_a_gap",
        "gpt",
        """
        mesh pp=2
        stage layers[0:1] -> 0
        stage layers[2:4] -> 1
        """,
        "3:1",
        ("layers[1:2] is in no stage", "lines 2 and 3", "gap"),
    ),
    BadSpec(
        "stage_id_not_below_pp",
        "gpt",
        """
        mesh pp=2
        stage layers[0:2] -> 0
        stage layers[2:4] -> 2
        """,
        "3:22",
        ("stage 2 does not exist", "pp=2", "0..1"),
    ),
    BadSpec(
        "pp_without_stage_statements",
        "gpt",
        """
        mesh pp=2 dp=2
        """,
        "1:1",
        ("pp=2", "no `stage` statement", "stage auto"),
    ),
    BadSpec(
        "stage_statements_without_pp",
        "gpt",
        """
        mesh dp=2
        stage layers[0:2] -> 0
        """,
        "2:1",
        ("need a pp axis", "mesh pp=2"),
    ),
    BadSpec(
        "stage_left_empty",
        "gpt",
        """
        mesh pp=3
        stage layers[0:2] -> 0
        stage layers[2:4] -> 2
        """,
        "3:1",
        ("stage 1 has no layers", "pp=3"),
    ),
    BadSpec(
        "first_stage_left_empty",
        "gpt",
        """
        mesh pp=2
        stage wte, wpe, layers[0:4], ln_f, lm_head -> 1
        """,
        "2:1",
        ("stage 0 has no layers", "pp=2"),
    ),
    BadSpec(
        "later_layers_on_an_earlier_stage",
        "gpt",
        """
        mesh pp=2
        stage layers[2:4] -> 0
        stage layers[0:2] -> 1
        """,
        "2:1",
        (
            "data flows backward",
            "'layers_2_ln_1' (stage 0)",
            "from stage 1",
            _gpt_line("x + self.attn(self.ln_1(x))"),
        ),
    ),
    BadSpec(
        "head_on_an_earlier_stage_than_the_layers_feeding_it",
        "gpt",
        """
        mesh pp=2
        stage layers[0:4] -> 1
        stage ln_f, lm_head -> 0
        """,
        "3:1",
        (
            "data flows backward",
            "'ln_f' (stage 0)",
            "from stage 1",
            _gpt_line("self.lm_head(self.ln_f(x))"),
        ),
    ),
    BadSpec(
        "stage_auto_without_pp",
        "gpt",
        """
        mesh dp=2
        stage auto
        """,
        "2:1",
        ("`stage auto` needs a pp axis", "mesh pp=2"),
    ),
    BadSpec(
        "stage_auto_with_more_stages_than_cut_points",
        "shallow_mlp",
        """
        mesh pp=4
        stage auto
        microbatches 2
        """,
        "2:1",
        ("at most 3 stages", "4 stages of pp=4", "lower pp to 3"),
    ),
    # --- mesh axes and their roles
    BadSpec(
        "shard_over_an_axis_not_in_the_mesh",
        "gpt",
        """
        mesh dp=2
        shard *.mlp.fc1 col tp
        """,
        "2:21",
        ("axis 'tp' is not in the mesh", "axes: dp", "mesh tp=2"),
    ),
    BadSpec(
        "shard_over_the_dp_axis",
        "gpt",
        """
        mesh dp=2
        shard *.mlp.fc1 col dp
        """,
        "2:21",
        ("'dp'", "data-parallel", "tensor-parallel axis"),
    ),
    BadSpec(
        "shard_over_the_pp_axis",
        "gpt",
        """
        mesh pp=2 tp=2
        shard *.mlp.fc1 col pp
        """,
        "2:21",
        ("'pp'", "pipeline", "tensor-parallel axis"),
    ),
    BadSpec(
        "mesh_axis_with_no_role",
        "gpt",
        """
        mesh dp=2 tp=2
        """,
        "1:11",
        ("mesh axis 'tp' has no role", "shard mlp.fc1 col tp"),
    ),
    BadSpec(
        "unused_extra_axis_beside_a_tp_axis",
        "gpt",
        """
        mesh ep=2 tp=2
        shard *.mlp.fc1 col tp
        """,
        "1:6",
        ("mesh axis 'ep' has no role",),
    ),
    BadSpec(
        "two_tensor_parallel_axes",
        "gpt",
        """
        mesh tp=2 mp=2
        shard *.mlp.fc1 col tp
        shard *.attn.qkv col mp
        """,
        "3:22",
        ("more than one tensor-parallel axis", "tp, mp"),
    ),
    # --- what a shard statement may name
    BadSpec(
        "module_sharded_both_col_and_row",
        "gpt",
        """
        mesh tp=2
        shard *.mlp.fc1 col tp
        shard layers.0.mlp.fc1 row tp
        """,
        "3:24",
        ("'layers.0.mlp.fc1'", "both col (line 2) and row"),
    ),
    BadSpec(
        "col_on_a_layernorm",
        "gpt",
        """
        mesh tp=2
        shard layers.0.ln_1 col tp
        """,
        "2:7",
        ("`col` applies to a Linear or an Embedding", "'layers.0.ln_1' is a LayerNorm"),
    ),
    BadSpec(
        "col_on_a_whole_block",
        "gpt",
        """
        mesh tp=2
        shard layers.0 col tp
        """,
        "2:7",
        ("'layers.0' is a Block", "e.g. `shard layers.0.attn.qkv col tp`"),
    ),
    BadSpec(
        "row_on_an_embedding",
        "gpt",
        """
        mesh tp=2
        shard wpe row tp
        """,
        "2:7",
        ("`row` applies to a Linear", "'wpe' is an Embedding", "`shard wpe col tp`"),
    ),
    BadSpec(
        "fp16_is_not_supported",
        "gpt",
        """
        precision fp16
        """,
        "1:11",
        ("`precision fp16` is not supported", "loss scaling", "`precision bf16`"),
    ),
    BadSpec(
        "bf16_reduction_of_fp32_gradients",
        "gpt",
        """
        mesh dp=2
        reduce bf16
        """,
        "2:8",
        ("`reduce bf16` under `precision fp32`", "`reduce fp32`"),
    ),
    # --- patterns that match nothing, with a did-you-mean
    BadSpec(
        "shard_pattern_matches_nothing",
        "gpt",
        """
        mesh tp=2
        shard *.mlp.fc3 col tp
        """,
        "2:7",
        ("pattern '*.mlp.fc3' matches no module", "did you mean '*.mlp.fc1'"),
    ),
    BadSpec(
        "stage_pattern_misspelt",
        "gpt",
        """
        mesh pp=2
        stage layer[0:2] -> 0
        stage layers[2:4] -> 1
        """,
        "2:7",
        ("pattern 'layer[0:2]' matches no module", "did you mean 'layers[0:2]'"),
    ),
    BadSpec(
        "stage_names_a_parameter_of_the_model_itself",  # e.g. a root nn.Parameter `pos`
        "gpt",
        """
        mesh pp=2
        stage wte, pos -> 0
        stage layers[0:4] -> 1
        """,
        "2:12",
        ("pattern 'pos' matches no module", "patterns name modules, not parameters"),
    ),
    BadSpec(
        "recompute_pattern_misspelt",
        "gpt",
        """
        recompute layers.0.mpl
        """,
        "1:11",
        ("pattern 'layers.0.mpl' matches no module", "did you mean 'layers.0.mlp'"),
    ),
    BadSpec(
        "range_past_the_last_layer",
        "gpt",
        """
        mesh tp=2
        shard layers[4:6].mlp.fc1 col tp
        """,
        "2:7",
        ("range layers[4:6] starts past the end of 'layers', which has 4 entries",),
    ),
]


@pytest.mark.parametrize("case", BAD_SPECS, ids=[c.id for c in BAD_SPECS])
def test_invalid_spec_is_a_plan_error_at_its_line(models: dict[str, Traced], case: BadSpec) -> None:
    with pytest.raises(PlanError) as info:
        plan_for(models, case.model, case.text, batch=case.batch)
    err = info.value
    text = str(err)
    line, column = (int(n) for n in case.where.split(":"))
    assert (err.line, err.column) == (line, column), text
    assert text.startswith(f"{SPEC_FILE}:{line}:{column}: error: "), text
    # The offending spec line, quoted, with a caret under the column.
    source_line = _spec_text(case.text).splitlines()[line - 1]
    quoted, caret = text.splitlines()[1:3]
    assert quoted == f"    {source_line}"
    assert caret.startswith(" " * (4 + column - 1) + "^"), text
    for fragment in case.says:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"


def test_the_catalogue_covers_at_least_thirty_mistakes() -> None:
    assert len(BAD_SPECS) >= 30
    assert len({c.id for c in BAD_SPECS}) == len(BAD_SPECS)


def test_plan_errors_name_the_model_names_involved(models: dict[str, Traced]) -> None:
    with pytest.raises(PlanError) as info:
        plan_for(models, "gpt", "mesh tp=2\nshard *.mlp.fc1 col tp\nshard layers.1.mlp.fc1 row tp")
    assert info.value.names == ("layers.1.mlp.fc1",)


# ---------------------------------------------------------------- valid specs


def test_3d_spec_resolves_shards_stages_and_batch(models: dict[str, Traced]) -> None:
    plan = plan_for(
        models,
        "gpt",
        """
        mesh pp=2 dp=2 tp=2
        shard *.attn.qkv col tp
        shard *.attn.proj row tp
        stage wte, wpe, layers[0:2] -> 0
        stage layers[2:4], ln_f, lm_head -> 1
        microbatches 2
        grad_accum 2
        zero 1
        schedule gpipe
        """,
        batch=16,
    )
    assert plan.mesh.world_size == 8
    assert (plan.pp, plan.dp, plan.tp, plan.tp_axis) == (2, 2, 2, "tp")
    assert [(s.module, s.kind, s.line) for s in plan.shards] == [
        *((f"layers.{i}.attn.qkv", ShardKind.COL, 2) for i in range(4)),
        *((f"layers.{i}.attn.proj", ShardKind.ROW, 3) for i in range(4)),
    ]
    assert plan.stage_modules == (
        ("wte", "wpe", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "ln_f", "lm_head"),
    )
    # 16 = micro 2 × microbatches 2 × grad_accum 2 × dp 2
    assert plan.batch.micro == 2
    assert plan.batch.per_replica == 8
    assert str(plan.batch) == "global 16 = micro-batch 2 × microbatches 2 × grad_accum 2 × dp 2"
    assert plan.warnings == ()


def test_partial_stage_lists_put_unnamed_modules_with_their_inputs(
    models: dict[str, Traced],
) -> None:
    plan = plan_for(
        models,
        "gpt",
        """
        mesh pp=2
        stage layers[0:2] -> 0
        stage layers[2:4] -> 1
        """,
    )
    # wte/wpe come before the first named stage, ln_f/lm_head after the last.
    assert plan.stage_modules == (
        ("wte", "wpe", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "ln_f", "lm_head"),
    )


def test_every_node_gets_stage_zero_without_pp(models: dict[str, Traced]) -> None:
    plan = plan_for(models, "gpt", "mesh dp=2")
    assert {stage for _, stage in plan.node_stages} == {0}
    assert len(plan.node_stages) == len(models["gpt"].gm.graph.nodes)


def test_a_freely_named_axis_is_the_tensor_parallel_axis(models: dict[str, Traced]) -> None:
    plan = plan_for(models, "gpt", "mesh dp=2 mp=4\nshard *.mlp.fc1 col mp\nshard wpe col mp")
    assert plan.tp_axis == "mp"
    assert plan.tp == 4
    assert plan.shard_of("wpe") is not None
    assert plan.shard_of("layers.3.mlp.fc1") is not None
    assert plan.shard_of("layers.3.mlp.fc2") is None


def test_zero_without_a_dp_axis_is_a_warning_not_an_error(models: dict[str, Traced]) -> None:
    plan = plan_for(models, "gpt", "mesh tp=2\nshard *.mlp.fc1 col tp\nzero 3")
    assert plan.zero == 3
    [warning] = plan.warnings
    assert isinstance(warning, PlanWarning)
    assert warning.span is not None and (warning.span.line, warning.span.column) == (3, 1)
    assert str(warning).startswith(f"{SPEC_FILE}:3:1: warning: zero 3")
    assert "nothing is sharded" in str(warning)


def test_zero_with_a_dp_axis_warns_nothing(models: dict[str, Traced]) -> None:
    assert plan_for(models, "gpt", "mesh dp=2\nzero 2").warnings == ()


def _layer_indices(names: tuple[str, ...]) -> list[int]:
    return sorted(int(n.split(".")[1]) for n in names if n.startswith("layers."))


def test_stage_auto_splits_a_uniform_deep_mlp_evenly(models: dict[str, Traced]) -> None:
    plan = plan_for(models, "mlp", "mesh pp=4\nstage auto\nmicrobatches 4")
    assert plan.stage_auto
    assert [_layer_indices(m) for m in plan.stage_modules] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "head" in plan.stage_modules[-1]


def test_stage_auto_report_prints_equivalent_explicit_stage_lines(
    models: dict[str, Traced], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in MLP_ENV.items():
        monkeypatch.setenv(key, value)
    analysis = analyse("mesh pp=4\nstage auto\nmicrobatches 4\n", EXAMPLES / "mlp.py")
    auto = analysis.plan
    report = format_report(auto, analysis.estimate, title="t")
    lines = stage_lines(auto)
    assert len(lines) == 4
    assert lines[0].startswith("stage layers[0:2]") and lines[0].endswith("-> 0")
    for line in lines:
        assert f"    {line}\n" in report
    # Pasting the lines in place of `stage auto` pins the same split, node by node.
    explicit = plan_for(models, "mlp", "mesh pp=4\n" + "\n".join(lines) + "\nmicrobatches 4")
    assert explicit.node_stages == auto.node_stages
    assert explicit.stage_modules == auto.stage_modules


def test_stage_auto_on_gpt_cuts_between_blocks_and_round_trips(
    models: dict[str, Traced],
) -> None:
    auto = plan_for(models, "gpt", "mesh pp=2\nstage auto\nmicrobatches 2")
    assert len(auto.stage_modules) == 2 and all(auto.stage_modules)
    explicit = plan_for(models, "gpt", "mesh pp=2\n" + "\n".join(stage_lines(auto)))
    assert explicit.node_stages == auto.node_stages


def test_a_parameter_a_layer_shares_with_a_module_parc_cannot_shard_names_that_module() -> None:
    # BERT's MLM head holds its decoder's bias itself: the hint said to shard the head
    # `col` with a `vocab` embedding, which the spec did (found by a probe).
    model = str(Path(__file__).parent / "models" / "tied_bias_head.py")
    with pytest.raises(PlanError) as caught:
        analyse("mesh tp=2\nshard head.decoder col tp\n", model, batch=4)
    hint = caught.value.hint or ""
    assert "'head' holds it itself and is no layer parc can shard" in hint
    assert "'head.decoder' (and what is tied to it) must stay replicated" in hint


def test_shards_over_a_tp_axis_of_size_one_are_warned_about() -> None:
    # `zero` over dp=1 was warned about, shard lines over tp=1 were not (found by a probe).
    plan = analyse("mesh dp=2 tp=1\nshard layers.0 col tp\n", EXAMPLES / "mlp.py").plan
    said = [w for w in plan.warnings if "nothing is split" in w.message]
    assert len(said) == 1 and said[0].span is not None and said[0].span.line == 2
    two = analyse("mesh dp=1 tp=2\nshard layers.0 col tp\n", EXAMPLES / "mlp.py").plan
    assert not [w for w in two.warnings if "nothing is split" in w.message]


def test_a_line_that_an_earlier_one_covers_is_warned_about(models: dict[str, Traced]) -> None:
    # `recompute layers[*]` then `recompute layers[0]` was accepted silently (a probe).
    plan = plan_for(models, "gpt", "mesh dp=2\nrecompute layers[*]\nrecompute layers[0].mlp\n")
    [warning] = [w for w in plan.warnings if "adds nothing" in w.message]
    assert warning.span is not None and warning.span.line == 3
    assert "already named by line 2" in warning.message
    plan = plan_for(
        models,
        "gpt",
        "mesh tp=2\nshard layers.*.mlp.fc1 col tp\nshard layers.0.mlp.fc1 col tp\n"
        "shard layers.1.mlp.fc2 row tp\n",
    )
    [warning] = [w for w in plan.warnings if "adds nothing" in w.message]
    assert warning.span is not None and warning.span.line == 3
    assert plan.shard_of("layers.0.mlp.fc1").line == 2  # type: ignore[union-attr]
    # Overlapping but adding modules: no warning.
    plan = plan_for(models, "gpt", "mesh dp=2\nrecompute layers[0]\nrecompute layers[*]\n")
    assert not [w for w in plan.warnings if "adds nothing" in w.message]


def test_a_range_over_a_second_name_of_a_shared_module_is_warned_about() -> None:
    # tests/models/shared_block.py holds one block at layers.0 and layers.2: `layers[2:4]`
    # on stage 1 left that call on stage 0, where layers.0 runs, and said nothing.
    model = str(Path(__file__).parent / "models" / "shared_block.py")
    spec = "mesh pp=2\nstage inp, layers[0:2] -> 0\nstage layers[2:4], head -> 1\n"
    plan = analyse(spec, model, batch=4).plan
    [warning] = [w for w in plan.warnings if "held a second time" in w.message]
    assert warning.span is not None and (warning.span.line, warning.span.column) == (3, 7)
    assert "'layers[2:4]' covers 'layers.2', which is the module 'layers.0'" in warning.message
    # A line that also names the first name reaches the module: nothing to say.
    plan = analyse("mesh dp=2\nrecompute layers[*]\n", model, batch=4).plan
    assert not [w for w in plan.warnings if "held a second time" in w.message]
