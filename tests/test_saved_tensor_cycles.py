"""A graph whose backward ran with retain_graph (zb1's B) is freed once nobody holds it,
under parc's saved-tensor hooks too.

A pack hook that returns a saved *output* as itself makes the saved value hold its own
node through the tensor's grad_fn: a cycle through Python that no `gc.collect()` frees
and only a backward without retain_graph breaks. zb1 runs B with retain_graph and W never
runs the input path again, so under ZeRO-3 (whose hook keeps ordinary tensors) every
microbatch's input-path graph would stay alive for good.
"""

from __future__ import annotations

import gc
import types
import weakref

import torch
import torch.nn.functional as F

from parc.runtime.zero3 import Zero3


def _outlives(pack: object) -> bool:
    """Whether an op's saved output outlives a retained backward and every reference."""
    x = torch.randn(2, 2, 16, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):  # type: ignore[arg-type]
        q = x * 2
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True).exp()
    ref = weakref.ref(out)
    torch.autograd.grad(out.sum(), [x], retain_graph=True)  # B keeps the graph for W
    del out, q
    gc.collect()
    return ref() is not None


def test_the_hazard_is_real_for_a_hook_that_keeps_the_tensor_itself() -> None:
    assert _outlives(lambda t: t)


def test_zero3s_hook_leaves_no_cycle_for_tensors_it_does_not_gather() -> None:
    zero3 = types.SimpleNamespace(_bases={})  # no gathered buffer: every tensor is ordinary
    assert not _outlives(lambda t: Zero3._pack(zero3, t))  # type: ignore[arg-type]
