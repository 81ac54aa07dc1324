"""Which ops run on a sequence shard under `sequence_parallel` (rules as data).

Sequence parallelism (Korthikanti et al., 2022) shards the activations between
tensor-parallel blocks along the sequence: norms over the hidden dim,
elementwise ops, residual adds, dropout and views that keep the sequence dim
compute on each rank's rows of the sequence. The placement rules are the ones of
compiler/passes/tp_rules.py (each already follows any `Shard`); this table says
which of them may keep a value on the sequence shard (`SEQ_RULES`), and how a
module that holds parameters is lowered there (`SEQ_MODULES`): its parameters
become graph inputs, so their gradients, partial over the sequence, are summed
over the axis (the analysis' `enter`), as Megatron sums its norms' gradients.

    >>> import torch.nn as nn
    >>> from parc.compiler.passes.tp_sequence_rules import SEQ_MODULES
    >>> SEQ_MODULES[nn.LayerNorm]
    <LowerKind.LAYER_NORM: 'layer_norm'>
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .placement import LowerKind, Shard
from .tp_context import Decision, OpContext, Rule
from .tp_rules import RULES, binary, layer_norm, unary
from .tp_view_rules import reduction, reshape

__all__ = ["SEQ_DROPOUT", "SEQ_MODULES", "SEQ_RULES", "norm_module"]


def norm_module(ctx: OpContext) -> Decision | None:
    """nn.LayerNorm / nn.RMSNorm: normalise the trailing `normalized_shape` dims; a sharded
    leading dim (the sequence) stays local."""
    owner = ctx.node.graph.owning_module
    assert owner is not None  # a module call's graph belongs to its GraphModule
    module = owner.get_submodule(str(ctx.node.target))
    s = ctx.sharded(ctx.arg(0))
    trailing = len(getattr(module, "normalized_shape", ()))
    if s is None or not trailing or s.dim >= len(ctx.shape(ctx.arg(0))) - trailing:
        return None
    return Decision(Shard(s.dim, s.blocks))


#: Modules with parameters that run on a sequence shard, and their functional form there.
SEQ_MODULES: dict[type[nn.Module], LowerKind] = {
    nn.LayerNorm: LowerKind.LAYER_NORM,
    nn.RMSNorm: LowerKind.RMS_NORM,
}

# Rules of tp_rules.RULES that keep a value on the sequence shard: elementwise (dropout,
# activations, casts), broadcasting binary ops (residual adds, norm weights), norms,
# reductions over other dims (RMSNorm's mean over the hidden dim), views keeping the dim.
_KEEP: tuple[Rule, ...] = (unary, binary, layer_norm, reduction, reshape)

#: Op key (as tp_rules.RULES keys it) -> rule, for the ops that may run on a sequence shard.
SEQ_RULES: dict[object, Rule] = {
    **{op: rule for op, rule in RULES.items() if rule in _KEEP},
    **{(module, None): norm_module for module in SEQ_MODULES},
}

#: Dropout ops whose mask the rank draws whole and slices (compiler/dropout.py's elementwise
#: kinds); feature dropout (`Dropout2d`, ...) draws per channel and is not on this list.
SEQ_DROPOUT: tuple[object, ...] = (torch.nn.functional.dropout, (nn.Dropout, None))
