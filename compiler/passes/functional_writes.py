"""Write in-place updates of activations out of place, so the graph's edges carry them.

torch.fx records `h.add_(1.0)` as a node whose result nothing reads, while the ops
after it read `h` itself and see the update only because it changed `h`'s memory.
A pass that gives `h` another tensor (tensor parallelism gathering it for an op with
no rule, a pipeline stage receiving it) then loses the update, or autograd refuses to
write into the received tensor. torch.export writes such updates out of place already;
this pass does the same for fx's graphs:

1. For each in-place write (compiler/model_state.py `inplace_writes`) straight into
   a tensor forward computed (not a parameter, buffer or model input; not through a
   view of it) that ops after the write still read, and no view of it taken before
   the write is read after it,
2. the write becomes its out-of-place form (`OUT_OF_PLACE`: `h.add(1.0)`; or
   compiler/ops/writes.py for `h[i] = v`, `copy_`, `zero_` and `fill_`), and
3. every op after it that read the tensor reads the new node instead.

A write with no out-of-place form here stays as it was.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..model_state import inplace_writes
from ..ops.writes import copied, filled, items_set, zeroed
from ..write_rules import OUT_OF_PLACE_OPS, is_view

__all__ = ["OUT_OF_PLACE", "augmented_writes", "functional_writes"]

# In-place methods whose out-of-place method takes the same arguments and returns
# what the in-place one leaves in `self` (rules as data).
# fmt: off
OUT_OF_PLACE: frozenset[str] = frozenset({
    "abs_", "add_", "addcdiv_", "addcmul_", "atan_", "ceil_", "clamp_", "clamp_max_",
    "clamp_min_", "clip_", "cos_", "div_", "exp_", "expm1_", "floor_", "fmod_", "index_add_",
    "index_copy_", "index_fill_", "lerp_", "log_", "log1p_", "masked_fill_", "masked_scatter_",
    "mul_", "nan_to_num_", "neg_", "pow_", "reciprocal_", "relu_", "remainder_", "round_",
    "rsqrt_", "scatter_", "scatter_add_", "sigmoid_", "sign_", "sin_", "sqrt_", "square_",
    "sub_", "tanh_", "tril_", "triu_", "trunc_",
})
# fmt: on
# Writes without such a method: (call_method name or function) -> the function.
_HELPERS: dict[object, Callable[..., Any]] = {
    operator.setitem: items_set,
    torch.Tensor.copy_: copied,
    torch.ops.aten.copy_.default: copied,  # `h[i] = v` as fx records it
    "copy_": copied,
    "zero_": zeroed,
    "fill_": filled,
}
_MADE_BY = ("call_function", "call_method", "call_module")


def augmented_writes(gm: torch.fx.GraphModule, inputs: Any) -> None:
    """`h += y` as eager runs it: on a tensor forward computed, an in-place write whose
    later readers through other names (`skip = h` before it) see it, so it becomes the
    out-of-place op with those readers rewired (as steps 2-3); on anything else (an int
    from a shape) the out-of-place op, which is what Python does. Which arguments are
    tensors: from one fake forward, run only when forward has such an update."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in OUT_OF_PLACE_OPS]
    if not nodes:
        return
    tensor = _tensor_nodes(gm, inputs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in nodes:
        base = node.args[0]
        written = isinstance(base, torch.fx.Node) and base in tensor
        if written and (
            base.op not in _MADE_BY or is_view(base) or _viewed_across(base, node, order)
        ):
            continue  # left in place, as eager runs it (write_rules.WRITE_CALLS lists it)
        node.target = OUT_OF_PLACE_OPS[node.target]
        if written:
            for user in [u for u in base.users if order[u] > order[node]]:
                user.replace_input_with(base, node)
    gm.graph.lint()
    gm.recompile()


def _tensor_nodes(gm: torch.fx.GraphModule, inputs: Any) -> set[torch.fx.Node]:
    from ..saved import profile_forward

    profile_forward(gm, inputs)
    return {n for n in gm.graph.nodes if hasattr(n.meta.get("tensor_meta"), "shape")}


def functional_writes(gm: torch.fx.GraphModule) -> list[str]:
    """Steps 1-3 on `gm`, in place; the names of the writes rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for write in inplace_writes(gm):
        base, index = _written_tensor(write)
        if base is None:
            continue
        later = [u for u in base.users if order[u] > order[write]]
        if not later or _viewed_across(base, write, order):
            continue
        made = _out_of_place(gm, write)
        if made is None:
            continue
        if index is not None:  # `h[i].mul_(2)`, `h[i] = v`: h with its items set
            with gm.graph.inserting_after(made):
                made = gm.graph.call_function(items_set, (base, index, made))
        for user in later:
            user.replace_input_with(base, made)
        done.append(write.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _written_tensor(write: torch.fx.Node) -> tuple[torch.fx.Node | None, Any]:
    """The tensor forward computed that the write changes, and the index when it writes
    an item view of it (`h[:, :4] = 0`, which fx records as a `copy_` into `h[:, :4]`,
    read by nothing else); (None, None) for anything else."""
    target = write.args[0]
    if not isinstance(target, torch.fx.Node) or target.op not in _MADE_BY:
        return None, None
    if target.op == "call_function" and target.target is operator.getitem:
        if not is_view(target):
            return None, None  # `h[[0, 1]].mul_(2)` writes a copy: h is left as it was
        base = target.args[0]
        if len(target.users) > 1 or not isinstance(base, torch.fx.Node):
            return None, None
        if base.op not in _MADE_BY or is_view(base):
            return None, None
        return base, target.args[1]
    return (None, None) if is_view(target) else (target, None)


def _viewed_across(target: torch.fx.Node, write: torch.fx.Node, order: dict) -> bool:
    """Whether a view of `target` taken before the write (which sees the write, where
    an out-of-place copy would not) is read after it."""
    todo = [u for u in target.users if order[u] < order[write] and is_view(u)]
    while todo:
        view = todo.pop()
        for user in view.users:
            if order[user] > order[write]:
                return True
            if is_view(user):
                todo.append(user)
    return False


def _out_of_place(gm: torch.fx.GraphModule, write: torch.fx.Node) -> torch.fx.Node | None:
    """Step 2: the write's out-of-place node, made beside it (the write is erased)."""
    name = str(write.target) if write.op == "call_method" else getattr(write.target, "__name__", "")
    with gm.graph.inserting_after(write):
        if write.op == "call_method" and name in OUT_OF_PLACE:
            made = gm.graph.call_method(name[:-1], write.args, write.kwargs)
        elif write.op == "call_function" and name in OUT_OF_PLACE and hasattr(torch, name[:-1]):
            made = gm.graph.call_function(getattr(torch, name[:-1]), write.args, write.kwargs)
        elif helper := _HELPERS.get(name if write.op == "call_method" else write.target):
            made = gm.graph.call_function(helper, write.args, write.kwargs)
        else:
            return None
    made.meta = dict(write.meta)
    write.replace_all_uses_with(made)
    gm.graph.erase_node(write)
    return made
