"""precision bf16 in the compiler: the capture, the fake profile, and the estimate's bytes.

The capture and the profile run at the compute dtype (compiler/capture.py,
compiler/saved.py); the memory per rank follows the ZeRO paper's 16Ψ (18Ψ with
`reduce fp32`) and the collectives' bytes the element sizes the runtime sends
(compiler/memory_model.py, compiler/estimate.py, compiler/traffic.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parc.compiler.model import load_model
from parc.compiler.model_output import call_model, input_tensors
from parc.compiler.trace import trace_model

ROOT = Path(__file__).resolve().parents[1]
HF_LLAMA = str(ROOT / "tests" / "models" / "hf" / "llama.py")


def _as_compute_copy(model: torch.nn.Module) -> None:
    """The bf16 compute copy in place: floating parameters bf16, buffers unchanged."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            p.data = p.data.to(torch.bfloat16)


def _casts(gm: torch.fx.GraphModule) -> list[torch.dtype]:
    """The dtype constants of the graph's `.to(...)` calls, in order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "to":
            found += [a for a in (*node.args[1:], *node.kwargs.values()) if a in _FLOATS]
    return found


_FLOATS = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("compute", [torch.bfloat16, None], ids=["bf16 capture", "fp32 capture"])
def test_an_exported_graph_casts_as_the_eager_bf16_model_does(compute: torch.dtype | None) -> None:
    """HF Llama's RMSNorm casts back to its input's dtype, a constant in the exported graph:
    captured with fp32 parameters it casts every norm's output to fp32 where the eager bf16
    model casts to bf16 (so the residual stream would run in fp32). Captured at the
    compute dtype, the graph under autocast is the eager bf16 model, bitwise."""
    source = load_model(HF_LLAMA)
    torch.manual_seed(0)
    model = source.build(device="cpu")
    sample, _ = source.batch(2, 0)
    gm = trace_model(model, sample, compute=compute)
    assert gm.meta["parc_capture"] == "export"
    _as_compute_copy(model)  # the graph reads the model's own parameters
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        eager = call_model(model, sample).logits
        graph = gm(*input_tensors(sample))
    casts = _casts(gm)
    if compute is None:  # the fp32 capture: fp32 constants where eager casts to bf16
        assert torch.bfloat16 not in casts
        assert graph.dtype != eager.dtype or not torch.equal(graph, eager)
        return
    assert torch.bfloat16 in casts  # each RMSNorm back to bf16, rotary's cos and sin to q's
    assert graph.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(graph, eager)
