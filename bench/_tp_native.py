"""bench/tp.py's native side: what DTensor tensor parallelism needs done to the example
models (their attention at local head counts, GPT's fused qkv rows interleaved) and
torchtitan's sequence-parallel plans around the blocks (bench/tp.py's docstring)."""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["block_sequence_plan", "localise_attention", "model_sequence_plan"]


def gpt_local_attention(self: Any, x: Any) -> Any:
    """examples/gpt.py's attention with local sizes: `self.n_head` is this rank's heads."""
    import torch.nn.functional as F

    B, T, _C = x.size()
    q, k, v = self.qkv(x).chunk(3, dim=2)  # the model: split(C); C is the replicated width
    q = q.view(B, T, self.n_head, -1).transpose(1, 2)
    k = k.view(B, T, self.n_head, -1).transpose(1, 2)
    v = v.view(B, T, self.n_head, -1).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return self.proj(y)


def llama_local_attention(self: Any, x: Any) -> Any:
    """examples/llama.py's attention (sdpa) with local sizes: head counts are this rank's."""
    import torch.nn.functional as F

    rotate_half = sys.modules[type(self).__module__].rotate_half
    B, T, _C = x.shape
    q = self.q(x).view(B, T, self.n_head, -1).transpose(1, 2)
    k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
    v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
    cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    repeats = self.n_head // self.n_kv_head
    k = k.repeat_interleave(repeats, dim=1)
    v = v.repeat_interleave(repeats, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o(y.transpose(1, 2).reshape(B, T, -1))  # the model: reshape(B, T, C)


def interleave_fused(linear: Any, parts: int, tp: int) -> None:
    """Reorder a fused Linear's output rows [a | b | c] as [a0 b0 c0 | a1 b1 c1 | ...]."""
    import torch

    with torch.no_grad():
        for p in (linear.weight, linear.bias):
            if p is not None:  # rows grouped as [part, rank, rows of that rank's piece]
                p.copy_(p.reshape(parts, tp, -1).transpose(0, 1).reshape(p.shape))


def localise_attention(pair: Any, block: Any, tp: int) -> None:
    attn = block.attn
    if pair.model == "gpt.py":
        interleave_fused(attn.qkv, 3, tp)
        attn.n_head //= tp
        attn.forward = types.MethodType(gpt_local_attention, attn)
    else:
        assert not attn.explicit, "the native copy of the attention covers sdpa only"
        attn.n_head //= tp
        attn.n_kv_head //= tp
        attn.forward = types.MethodType(llama_local_attention, attn)


def block_sequence_plan(pair: Any) -> dict[str, Any]:
    """torchtitan's sequence-parallel plan of a block: norms on Shard(1), the input of
    attention and the MLP gathered, the row layers' outputs reduce-scattered to Shard(1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for norm, consumer in pair.sp_norms.items():
        plan[norm] = SequenceParallel()
        plan[consumer] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    for name, kind in pair.plan.items():
        if pair.sp_norms and kind == "row":
            plan[name] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def model_sequence_plan(pair: Any) -> dict[str, Any]:
    """Around the blocks: the embeddings' sum sliced onto the sequence before block 0, the
    final norm on Shard(1), its output gathered for the replicated LM head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    return {
        "layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        pair.final_norm: SequenceParallel(),
        "lm_head": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
