"""Which functional form a sharded module call is lowered to (rules as data).

The analysis (tp_analysis.py) records a `Lowering` for every sharded module
call; the rewrite (functional.emit_lowered) writes it. A module with a linear
form (compiler/linear_forms.py) is lowered as nn.Linear.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx

from parc.dsl.ast import ShardKind

from ..linear_forms import linear_form
from ..plan import ModuleShard
from .placement import Lowering, LowerKind, ParamUse, Shard

__all__ = ["LOWERINGS", "module_lowering"]

#: (module class, shard kind) -> its lowering.
LOWERINGS: Mapping[tuple[type[torch.nn.Module], ShardKind], LowerKind] = {
    (torch.nn.Linear, ShardKind.COL): LowerKind.LINEAR_COL,
    (torch.nn.Linear, ShardKind.ROW): LowerKind.LINEAR_ROW,
    (torch.nn.Embedding, ShardKind.COL): LowerKind.EMBEDDING_COL,
    (torch.nn.Embedding, ShardKind.VOCAB): LowerKind.EMBEDDING_VOCAB,
}


def module_lowering(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    shard: ModuleShard,
    canonical: Mapping[str, str],
    params: Mapping[str, Shard],
) -> Lowering:
    """The lowering of sharded module call `node`, reading its parameters' slices `params`
    (by canonical name)."""
    module = gm.get_submodule(str(node.target))
    cls = torch.nn.Linear if linear_form(module) is not None else type(module)
    kind = next(v for (c, k), v in LOWERINGS.items() if issubclass(cls, c) and k is shard.kind)
    uses = []
    for attr, _ in module.named_parameters(recurse=False):
        name = canonical[f"{node.target}.{attr}"]
        uses.append(ParamUse(attr, name, params.get(name)))
    return Lowering(kind, tuple(uses))
