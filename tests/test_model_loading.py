"""Model files: a broken one is a clear error naming the file and the fix; a good one compiles.

Every file under tests/models/ but custom_ok.py breaks the model convention
(docs/architecture.md, Model convention) or cannot be traced in one way. Each goes through the
whole front end (`analyse`, as `parc compile` does) and must fail with the
right error type, name the file (and, where there is one, the line), say what
went wrong with the values seen, and say how to fix it.

custom_ok.py is a good model with names, a custom norm and a buffer that the
examples do not have; it must trace and resolve, and `.par` patterns must
reach nodes inside its non-leaf modules through `nn_module_stack`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from parc.compiler.frontend import analyse
from parc.compiler.model import load_model
from parc.compiler.plan import Plan
from parc.compiler.resolve import resolve
from parc.compiler.trace import module_path, propagate_shapes, trace_model
from parc.dsl import ShardKind, parse_spec
from parc.errors import CompileError, ModelError, ParcError, PlanError

MODELS = Path(__file__).parent / "models"
SPEC = "mesh dp=2\n"  # global batch 8: sample_batch is called as sample_batch(4, 0)


def _line_of(file: str, code: str) -> str:
    """`file:N` of the first line of tests/models/<file> that holds `code`."""
    lines = (MODELS / file).read_text().splitlines()
    return f"{MODELS / file}:{next(i for i, line in enumerate(lines, 1) if code in line)}"


@dataclass(frozen=True)
class Broken:
    """A broken model file and what its error must say."""

    file: str
    error: type[ParcError]
    says: tuple[str, ...]  # what failed, with the values seen
    fix: str  # a fragment of the advice
    at: str | None = None  # code on the line the error must point to

    def __str__(self) -> str:
        return self.file.removesuffix(".py")


BROKEN = [
    Broken(
        "unused_param.py",
        ModelError,
        ("forward never reads parameters 'spare.weight', 'spare.bias' (2 of 4)",),
        "remove the unused module or parameter from build_model()",
    ),
    Broken(
        "no_build_model.py",
        ModelError,
        ("defines no `build_model`",),
        "must define build_model() and sample_batch(batch_size, step)",
    ),
    Broken(
        "no_sample_batch.py",
        ModelError,
        ("defines no `sample_batch`",),
        "must define build_model() and sample_batch(batch_size, step)",
    ),
    Broken(
        "function_not_callable.py",
        ModelError,
        ("`sample_batch` is an int, not a function",),
        "define it with `def sample_batch(...)`",
    ),
    Broken(
        "build_returns_dict.py",
        ModelError,
        ("build_model() returned a dict",),
        "it must return a torch.nn.Module",
    ),
    Broken(
        "batch_single_tensor.py",
        ModelError,
        ("sample_batch(4, 0) returned a tensor of shape (4, 4)",),
        "it must return a pair (inputs, targets)",
    ),
    Broken(
        "batch_three_items.py",
        ModelError,
        ("sample_batch(4, 0) returned a tuple of 3 items",),
        "it must return a pair (inputs, targets)",
    ),
    Broken(
        "batch_not_tensors.py",
        ModelError,
        ("sample_batch(4, 0) returned inputs as a list of 4 items",),
        "inputs must be a tensor (inputs: or a tuple or a dict of tensors)",
    ),
    Broken(
        "batch_wrong_dim.py",
        ModelError,
        ("sample_batch(4, 0) returned inputs of shape (6, 4, 4)",),
        "dim 0 must be the batch size 4",
    ),
    Broken(
        "import_raises.py",
        ModelError,
        ("importing the model file raised KeyError: 'width'",),
        "it must import without errors",
        at='WIDTH = CONFIG["width"]',
    ),
    Broken(
        "build_raises.py",
        ModelError,
        ("build_model() raised ValueError: dim 10 is not divisible by heads 4",),
        "",  # the model's own message is the advice
        at="raise ValueError(",
    ),
    Broken(
        "sample_batch_raises.py",
        ModelError,
        ("sample_batch(4, 0) raised FileNotFoundError", "no_such_dataset.pt"),
        "",
        at="data = torch.load(",
    ),
    Broken(
        "data_dependent_if.py",
        CompileError,
        ("module 'encoder.2' (Gate) cannot be traced", "data-dependent `if`"),
        "use torch.where for data-dependent choices",
        at="if h.mean() > 0:",
    ),
    Broken(
        "shape_mismatch.py",
        CompileError,
        (
            "failed at node 'embed'",
            "[4, 12] X [16, 32]",
            "fx node: %embed : [num_users=1] = call_module[target=embed]",
        ),
        "check that sample_batch returns inputs the model accepts",
        at="h = torch.tanh(self.embed(x))",
    ),
]


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_broken_model_file_is_a_clear_error(case: Broken) -> None:
    path = MODELS / case.file
    with pytest.raises(ParcError) as info:
        analyse(SPEC, path)
    err = info.value
    text = str(err)
    assert type(err) is case.error, text
    assert str(path) in text, text  # names the file
    for fragment in case.says:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    assert case.fix in text, text
    if case.at is not None:
        assert f"{_line_of(case.file, case.at)}: {case.at}" in text, text
    assert "Traceback" not in text


def test_there_are_at_least_ten_broken_model_files() -> None:
    assert len(BROKEN) >= 10
    # Other test files add models of their own (working ones, and run-time faults).
    on_disk = {p.name for p in MODELS.glob("*.py")}
    assert {case.file for case in BROKEN} <= on_disk


def test_model_error_header_names_the_file() -> None:
    with pytest.raises(ModelError) as info:
        analyse(SPEC, MODELS / "no_build_model.py")
    assert info.value.file == str(MODELS / "no_build_model.py")
    assert str(info.value).startswith(f"{MODELS / 'no_build_model.py'}: error: ")


def test_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "typo.py"
    path.write_text("import torch\n\n\ndef build_model(:\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(ModelError) as info:
        load_model(path)
    text = str(info.value)
    assert text.startswith(f"{path}: error: syntax error at line 4")
    assert "def build_model(:" in text
    assert "fix line 4" in text


def test_a_syntax_error_in_a_module_the_file_imports_names_that_module(tmp_path: Path) -> None:
    # It was reported at the model file's line 4, which has no error (found by a probe).
    (tmp_path / "helper_with_typo.py").write_text("x = 1\n\n\ndef f(:\n    pass\n")
    path = tmp_path / "uses_helper.py"
    path.write_text("import sys\nsys.path.insert(0, __file__.rsplit('/', 1)[0])\n"
                    "import helper_with_typo\n")  # fmt: skip
    with pytest.raises(ModelError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{tmp_path / 'helper_with_typo.py'}: error: syntax error at")
    assert f"imported by the model file {path}" in str(info.value)


def test_a_binary_file_is_no_python_file(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(b"\x00\x01binary")  # said "syntax error at line None; fix line None"
    with pytest.raises(ModelError) as info:
        load_model(path)
    assert "is not a Python file" in str(info.value) and "None" not in str(info.value)


def test_a_torch_error_is_quoted_without_its_cpp_stack(tmp_path: Path) -> None:
    # `--batch 1e20`'s overflow in torch.randint showed torch's "Exception raised from
    # ..." and 16 C++ frames.
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n\n\ndef build_model():\n    return torch.nn.Linear(2, 2)\n\n\n"
        "def sample_batch(b, step):\n"
        "    return torch.randint(0, 2, (b, 2)).float(), torch.zeros(b, dtype=torch.long)\n"
    )
    with pytest.raises(ModelError) as info:
        load_model(path).batch(10**20, 0)
    text = str(info.value)
    assert "sample_batch(100000000000000000000, 0) raised" in text and "Overflow" in text
    assert "Exception raised from" not in text and "frame #" not in text
    assert f"at {path}:9" in text


def test_missing_model_file_is_a_model_error(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.py"
    with pytest.raises(ModelError) as info:
        load_model(path)
    assert str(info.value) == f"{path}: error: no such model file"


def test_a_failed_import_can_be_retried_after_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "flaky.py"
    path.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(ModelError):
        load_model(path)
    path.write_text(
        "import torch\n\n\ndef build_model():\n    return torch.nn.Linear(2, 2)\n\n\n"
        "def sample_batch(b, step):\n"
        "    return torch.zeros(b, 2), torch.zeros(b, dtype=torch.long)\n"
    )
    assert load_model(path).build().out_features == 2


# ---------------------------------------------------------------- a good custom model


CUSTOM = MODELS / "custom_ok.py"
CUSTOM_SPEC = """\
mesh pp=2 tp=2
shard *.up col tp
shard *.down row tp
stage blocks[0:2] -> 0
stage blocks[2:4] -> 1
microbatches 2
"""


@dataclass(frozen=True)
class Resolved:
    plan: Plan
    gm: torch.fx.GraphModule


def _resolve_custom(spec_text: str, blocks: int = 4) -> Resolved:
    """Trace custom_ok.py (on `meta`) and resolve `spec_text` against it at global batch 8."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUSTOM_BLOCKS", str(blocks))
        source = load_model(CUSTOM)
        model = source.build(device="meta")
        gm = trace_model(model)
        inputs, _ = source.batch(2, 0)
        propagate_shapes(gm, (inputs,))
    return Resolved(resolve(parse_spec(spec_text), model, gm, batch=8), gm)


@pytest.fixture(scope="module")
def custom() -> Resolved:
    return _resolve_custom(CUSTOM_SPEC)


def test_custom_model_traces_and_resolves(custom: Resolved) -> None:
    plan = custom.plan
    assert [(s.module, s.kind) for s in plan.shards] == [
        *((f"blocks.{i}.up", ShardKind.COL) for i in range(4)),
        *((f"blocks.{i}.down", ShardKind.ROW) for i in range(4)),
    ]
    # stem is not named: it comes before stage 0's blocks; out after stage 1's.
    assert plan.stage_modules == (("stem", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "out"))
    assert plan.batch.micro == 4


def _stages_inside(resolved: Resolved, module: str) -> set[int]:
    stage_of = resolved.plan.stage_of()
    return {
        stage_of[n.name]
        for n in resolved.gm.graph.nodes
        if module in module_path(n) and n.op != "call_module"
    }


def test_stage_patterns_reach_nodes_inside_non_leaf_modules(custom: Resolved) -> None:
    # The RMSNorm is traced through: its ops are call_function/call_method nodes
    # and its raw nn.Parameter a get_attr node, all under blocks.<i> in
    # nn_module_stack. `stage blocks[0:2] -> 0` must take them along.
    ops = [n for n in custom.gm.graph.nodes if "blocks.1.norm" in module_path(n)]
    assert {n.op for n in ops} >= {"call_function", "call_method", "get_attr"}
    assert _stages_inside(custom, "blocks.1.norm") == {0}
    assert _stages_inside(custom, "blocks.2.norm") == {1}
    assert _stages_inside(custom, "blocks.1") == {0}
    assert _stages_inside(custom, "blocks.3") == {1}


def test_a_custom_norm_can_be_named_in_a_stage_line() -> None:
    resolved = _resolve_custom(
        "mesh pp=2\n"
        "stage stem, blocks.0, blocks.1.norm -> 0\n"
        "stage blocks.1.up, blocks.1.down, blocks[2:4], out -> 1\n"
    )
    assert resolved.plan.stage_modules[0] == ("stem", "blocks.0", "blocks.1.norm")
    assert _stages_inside(resolved, "blocks.1.norm") == {0}
    assert "blocks.1.up" in resolved.plan.stage_modules[1]


def test_a_custom_norm_cannot_be_sharded() -> None:
    with pytest.raises(PlanError) as info:
        _resolve_custom("mesh tp=2\nshard blocks.0.norm col tp\n", blocks=2)
    assert "'blocks.0.norm' is a RMSNorm" in str(info.value)
    assert info.value.names == ("blocks.0.norm",)


def test_custom_model_with_a_buffer_compiles_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUSTOM_BLOCKS", "4")
    analysis = analyse(CUSTOM_SPEC, CUSTOM)
    # The buffer pos_scale is no stage's parameter.
    stem, block, out = 12 * 16 + 16, 16 + (16 * 64 + 64) + (64 * 16 + 16), 16 * 5 + 5
    assert [s.params for s in analysis.estimate.stages] == [stem + 2 * block, 2 * block + out]
