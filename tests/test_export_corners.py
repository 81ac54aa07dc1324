"""torch.export captures of what real models' forwards do (tests/models/export_corners.py),
each trained under dp and pp against one device. Before: an `nn.Embedding` subclass
with its own forward (Gemma) was turned into a call of the module and its scale applied
twice (a silently different model); `t[:, 0] = c` (T5) failed to trace (`x.view()` of an
empty size) and, traced, its in-place copy was dropped by the pipeline split as unread;
a list index (Falcon) became a meta constant that failed every rank at launch; a tensor
made from the inputs and written in place (T5's decoder inputs), made again on the stage
that reads it, lacked the writes there (a different loss from step 0).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, check_equivalent

from parc.compiler.frontend import analyse
from parc.runtime.equivalence import model_env

MODEL = str(ROOT / "tests" / "models" / "export_corners.py")
CORNERS = ("scaled", "setitem", "list_index")
SPECS = {"dp": "mesh dp=2\n", "pp": "mesh pp=2\nstage auto\nmicrobatches 2\n"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("corner", CORNERS)
def test_trains_as_one_device(gloo_pool, corner: str, spec: str) -> None:
    # SGD, and the tolerances every equivalence test uses (Tolerance.for_optimizer).
    env = {"EXPORT_CORNER": corner}
    comparison, _ = check_equivalent(gloo_pool, SPECS[spec], MODEL, env=env, steps=2)
    assert comparison.ok, comparison


def test_the_captured_graph_computes_what_the_model_does() -> None:
    from parc.compiler.model import load_model

    with model_env({}):
        source = load_model(MODEL)
        analysis = analyse("mesh dp=2\n", source, batch=4, device="cpu")
        inputs, _ = source.batch(2, 0)  # the micro-batch the graph holds: 4 over dp=2
        expected = analysis.model(**inputs)
        got = analysis.gm(inputs["input_ids"])
    assert analysis.plan.capture.startswith("captured with torch.export")
    assert torch.allclose(got, expected), (got - expected).abs().max()


@pytest.mark.multiprocess
def test_a_stage_making_a_written_tensor_again_writes_it_too(gloo_pool) -> None:
    spec = "mesh pp=2\nstage emb, mid -> 0\nstage late, head -> 1\n"
    env = {"EXPORT_CORNER": "late"}
    comparison, _ = check_equivalent(gloo_pool, spec, MODEL, env=env, steps=2)
    assert comparison.ok, comparison


def test_only_a_lost_constant_exports_again_on_the_cpu() -> None:
    # Llama's rotary frequencies are non-persistent buffers, constants to export that
    # parc reads from the model itself: its capture stays on meta (one export, nothing
    # allocated); the list index's constant is lost on meta and needs the CPU export.
    pytest.importorskip("transformers")
    from parc.compiler.capture import export_model
    from parc.compiler.model import load_model

    for path, device in ((ROOT / "tests/models/hf/llama.py", "meta"), (MODEL, "cpu")):
        source = load_model(str(path))
        inputs, _ = source.batch(2, 0)
        assert export_model(source.build(), inputs)[1].type == device, path
