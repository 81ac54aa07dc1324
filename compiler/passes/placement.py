"""Tensor-parallel placements, and the records the TP analysis leaves for the rewrite.

A placement says how one value lives on the ranks of the tensor-parallel axis
(docs/architecture.md, tensor_parallel): small immutable values that print as in the design's
table:

    >>> Replicate(), Shard(2), Shard(2, blocks=3), Partial()
    (R, S(2), S(2,3), P)

`Shard(dim, blocks=k)`: dim `dim` is k equal blocks, each split into equal
contiguous parts over the axis, rank i holding part i of every block (a fused
qkv output is `S(2,3)`). Dims are non-negative (the analysis knows every rank).
How a value changes placement (all-reduce, all-gather, slice, ...) is the
table of compiler/conversions.py.

The analysis (tp_analysis.py) writes, per fx node, into its `ParcMeta`
(compiler/node_meta.py):

- `tp`: the output's placement (a tuple of placements for a node whose output
  is a tuple, e.g. `split`); non-tensor values are `R`.
- `tp_rewrite`: a `NodeRewrite` when the node needs more than a plain copy:
  input conversions, size arguments to make local, a lowering of a sharded
  module call.
- `sharded`, `collectives`: for the cost estimate (compiler/estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # conversions.py builds its table from the placements here
    from ..conversions import Conversion

__all__ = [
    "ArgPath",
    "LowerKind",
    "Lowering",
    "NodeRewrite",
    "ParamUse",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "SizeFix",
    "SizeOp",
]


@dataclass(frozen=True, slots=True)
class Replicate:
    """The same whole value on every rank."""

    def __repr__(self) -> str:
        return "R"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class Shard:
    """Dim `dim` split over the axis, in `blocks` equal blocks each split separately."""

    dim: int
    blocks: int = 1

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},{self.blocks})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class Partial:
    """A pending sum: the value is the sum over the axis of every rank's tensor."""

    def __repr__(self) -> str:
        return "P"

    __str__ = __repr__


Placement: TypeAlias = Replicate | Shard | Partial


ArgPath: TypeAlias = tuple[int | str, ...]
"""Where an argument sits: `(3,)` is args[3], `(1, 2)` args[1][2], `("dim",)` kwargs["dim"]."""


class SizeOp(str, Enum):
    """How a size argument becomes the local size."""

    DIV = "div"  # a global size of a sharded dim: constant c → c // tp, a node → node // tp
    MUL = "mul"  # a size read from a sharded tensor used where the global size is meant

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class SizeFix:
    path: ArgPath
    op: SizeOp


class LowerKind(str, Enum):
    """A sharded module call lowered to its functional form."""

    LINEAR_COL = "linear_col"  # F.linear(x, w[rows], b[rows])
    LINEAR_ROW = "linear_row"  # F.linear(x, w[:, cols]) → all-reduce → + b
    EMBEDDING_COL = "embedding_col"  # F.embedding(idx, w[:, cols])
    EMBEDDING_VOCAB = "embedding_vocab"  # tp_vocab_lookup(idx, w[rows], first row): P
    # sequence parallel (compiler/passes/tp_sequence_lower.py): on the sequence shard
    LINEAR_ROW_SCATTER = "linear_row_scatter"  # F.linear(x, w[:, cols]) → reduce-scatter → + b
    LAYER_NORM = "layer_norm"  # F.layer_norm(x, shape, enter(w), enter(b), eps)
    RMS_NORM = "rms_norm"  # F.rms_norm(x, shape, enter(w), eps)
    SEQ_DROPOUT = "seq_dropout"  # the whole mask drawn, the rank's rows of it applied

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ParamUse:
    """A module parameter read by a lowered call: `attr` of the module, stored at `target`.

    `shard` is how the local parameter is cut from the full one (None: whole).
    """

    attr: str
    target: str
    shard: Shard | None


@dataclass(frozen=True, slots=True)
class Lowering:
    kind: LowerKind
    params: tuple[ParamUse, ...]

    def param(self, attr: str) -> ParamUse | None:
        return next((p for p in self.params if p.attr == attr), None)


@dataclass(frozen=True, slots=True)
class NodeRewrite:
    """What the rewrite does to one node beyond copying it.

    `converts`: (input node name, conversion) for inputs whose placement must
    change first (a conversion of the same value is shared by its consumers);
    `sizes`: size arguments to make local; `lowering`: a sharded module call;
    `param`: a `get_attr` that reads a sharded parameter.
    """

    converts: tuple[tuple[str, Conversion], ...] = ()
    sizes: tuple[SizeFix, ...] = ()
    lowering: Lowering | None = None
    param: ParamUse | None = None  # a get_attr of a sharded parameter: its local slice

    def __bool__(self) -> bool:
        return bool(self.converts or self.sizes or self.lowering or self.param)
