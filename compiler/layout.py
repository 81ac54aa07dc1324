"""Where every parameter lives: its tensor-parallel slice, its stages, its flat ZeRO unit.

The compiler's report and the runtime both read this one layout, so the
memory and traffic the report predicts are the ones a run has.

- A parameter sharded over the tp axis keeps one slice along `dim`
  (Linear col: weight and bias dim 0; Linear row: weight dim 1, the bias stays
  whole and is added once after the reduction; Embedding col: weight dim 1;
  Embedding vocab: weight dim 0, its rows).
  A vocabulary the axis does not divide (a `vocab` Embedding, a `col` LM head of V
  outputs) is padded on the device: every rank holds ceil(V/tp) rows (columns of the
  logits), rank i the true rows [i·c, min((i+1)·c, V)) and zero rows after them
  (`ParamSlice.padding` in all). The padding exists only in the ranks' local tensors:
  full shapes, checkpoints and exports have V (`held_range`).
  A linear map whose weight is (in, out) (compiler/linear_forms.py, GPT-2's
  Conv1D) is cut on the other dim of its weight: col dim 1, row dim 0.
- A parameter used by two stages (a tied embedding and LM head) lives on both.
- ZeRO units are flat buffers padded to a multiple of dp: one per module (or
  raw parameter) for ZeRO-3, so each is gathered just before its use; for DP
  and ZeRO-1/2, buckets of about `bucket_elems` elements filled in reverse order
  of use (the order gradients become ready in backward).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch
import torch.fx

from parc.dsl.ast import ShardKind
from parc.errors import PlanError

from .blocks import Blocks
from .cost import params_of_node
from .linear_forms import linear_form
from .plan import ModuleShard, Plan

__all__ = [
    "DEFAULT_BUCKET_ELEMS",
    "FlatUnit",
    "ParamSlice",
    "canonical_names",
    "flat_units",
    "frozen_params",
    "held_range",
    "local_part",
    "local_shape",
    "pad_dim",
    "param_slices",
    "stage_params",
    "zero3_owner",
]

# DDP's default bucket is 25 MiB, its first one 1 MiB; in fp32 elements:
DEFAULT_BUCKET_ELEMS = 25 * 2**20 // 4
FIRST_BUCKET_ELEMS = 2**20 // 4


@dataclass(frozen=True, slots=True)
class ParamSlice:
    """A parameter split along `dim` into `parts` slices over the tp axis.

    With `blocks` = k > 1 the dim is k equal blocks (a fused q/k/v weight) and each
    rank keeps its slice of every block. `padding`: zero rows appended along `dim` on
    the device so it divides by `parts` (a vocabulary tp does not divide; one block).
    """

    dim: int
    parts: int
    blocks: int = 1
    padding: int = 0

    def __post_init__(self) -> None:
        if self.padding and self.blocks != 1:
            raise ValueError(f"a padded slice has one block, not {self.blocks}")

    def local(self, size: int) -> int:
        """The rank's length along `dim` of a full `size` (padding included)."""
        return (size + self.padding) // self.parts


@dataclass(frozen=True, slots=True)
class FlatUnit:
    """Parameters flattened together (in order) and padded to a multiple of dp."""

    params: tuple[str, ...]
    numel: int
    padded: int
    dp: int

    @property
    def shard(self) -> int:
        """Elements of this unit each dp rank keeps under ZeRO."""
        return self.padded // self.dp


def param_slices(plan: Plan, model: torch.nn.Module) -> dict[str, ParamSlice]:
    """Canonical parameter name -> its tp slice; tied parameters must agree."""
    canonical = canonical_names(model)
    out: dict[str, tuple[ParamSlice | None, str]] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        shard = plan.shard_of(name)
        if shard is not None and not _shardable(module):  # its own forward, traced through
            raise _traced_through(shard)
        for leaf, _ in module.named_parameters(recurse=False):
            full = f"{name}.{leaf}" if name else leaf
            slice_ = _slice_for(shard.kind, leaf, module, plan.tp) if shard else None
            key = canonical[full]
            if key in out and out[key][0] != slice_:
                raise _tie_conflict(key, out[key][1], name, plan, modules)
            out.setdefault(key, (slice_, name))
    return {k: v[0] for k, v in out.items() if v[0] is not None}


def _slice_for(kind: ShardKind, leaf: str, module: torch.nn.Module, tp: int) -> ParamSlice | None:
    """The slice of `module`'s parameter `leaf`; None for one its layer's call does not
    read (a subclass's own extra parameters, a LoRA's A and B, stay whole)."""
    if isinstance(module, torch.nn.Embedding):  # vocab: its rows; col: its embedding dim
        if leaf != "weight":
            return None
        if kind is ShardKind.VOCAB:
            return ParamSlice(0, tp, padding=-module.num_embeddings % tp)
        return ParamSlice(1, tp)
    form = linear_form(module)
    assert form is not None, "param_slices refused a module it cannot split"
    if leaf not in (form.weight, form.bias):
        return None
    if kind is ShardKind.COL:  # outputs tp does not divide are padded (an LM head's vocab)
        pad = -form.out_features % tp
        return ParamSlice(form.out_dim if leaf == form.weight else 0, tp, padding=pad)
    return ParamSlice(form.in_dim, tp) if leaf == form.weight else None


def _traced_through(shard: ModuleShard) -> PlanError:
    """A layer resolve took for a Linear or an Embedding (its class is one) whose own
    forward the graph holds instead of its call: a subclass that overrides forward."""
    return PlanError(
        f"'{shard.module}' is {shard.module_type}, a subclass whose own forward computes more "
        f"than a {'lookup' if shard.kind is ShardKind.VOCAB else 'linear map'} (or computes it "
        f"in a way parc does not recognise), so parc cannot split it `{shard.kind}` yet",
        None,
        hint=f"leave '{shard.module}' replicated (remove it from the shard statement on spec "
        f"line {shard.line}), or make its forward the base class's and do the rest around it",
        names=(shard.module,),
    )


def _tie_conflict(
    param: str, first: str, second: str, plan: Plan, modules: dict[str, torch.nn.Module]
) -> PlanError:
    def describe(module: str) -> str:
        shard = plan.shard_of(module)
        return f"'{module}' ({shard.kind} {shard.axis})" if shard else f"'{module}' (replicated)"

    line = next((s.line for s in plan.shards if s.module in (first, second)), None)
    hint = (
        "a tied weight must be split the same way by every module that uses it: e.g. "
        "shard the Embedding `col` and the tied LM head `row`, or the Embedding `vocab` and "
        "the head `col`, or untie them"
    )
    holder = next((m for m in (first, second) if not _shardable(modules.get(m))), None)
    if holder is not None:  # e.g. BERT's `cls.predictions.bias`, tied to its decoder's
        sharded = second if holder == first else first
        hint = (
            f"'{holder}' holds it itself and is no layer parc can shard, so '{sharded}' "
            "(and what is tied to it) must stay replicated, or untie them in the model"
        )
    return PlanError(
        f"parameter '{param}' is shared by {describe(first)} and {describe(second)}, which "
        "slice it differently",
        None,
        hint=hint + (f" (spec line {line})" if line else ""),
        names=(param, first, second),
    )


def _shardable(module: torch.nn.Module | None) -> bool:
    return isinstance(module, torch.nn.Embedding) or (
        module is not None and linear_form(module) is not None
    )


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name (tied ones included) -> the first name of that tensor."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def frozen_params(model: torch.nn.Module) -> frozenset[str]:
    """The canonical names of the parameters that take no gradient (`requires_grad=False`:
    frozen, as in fine-tuning). They are in no gradient unit: never reduced, never stepped,
    as a plain loop's optimizer skips a parameter whose `.grad` stays None."""
    return frozenset(n for n, p in model.named_parameters() if not p.requires_grad)


def local_shape(shape: tuple[int, ...], slice_: ParamSlice | None) -> tuple[int, ...]:
    """A parameter's shape on one tp rank (padding included)."""
    if slice_ is None:
        return shape
    dims = list(shape)
    dims[slice_.dim] = slice_.local(dims[slice_.dim])
    return tuple(dims)


def held_range(size: int, slice_: ParamSlice, index: int) -> tuple[int, int]:
    """The true rows [lo, hi) of a full `size` that rank `index` holds (one block); its
    local rows [0, hi - lo) are them, the rest up to `slice_.local(size)` are padding
    (none, or every row on a rank past the vocabulary's end)."""
    each = slice_.local(size)
    lo = min(index * each, size)
    return lo, min(lo + each, size)


def pad_dim(full: torch.Tensor, dim: int, padding: int) -> torch.Tensor:
    """`full` with `padding` zero rows appended along `dim` (itself when none)."""
    if not padding:
        return full
    shape = list(full.shape)
    shape[dim] = padding
    return torch.cat([full, full.new_zeros(shape)], dim=dim)


def local_part(full: torch.Tensor, slice_: ParamSlice, index: int) -> torch.Tensor:
    """Rank `index`'s part of a full parameter: its slice of each block along `slice_.dim`
    (padded with zero rows where the layout pads), a new tensor."""
    padded = pad_dim(full, slice_.dim, slice_.padding)
    size = padded.shape[slice_.dim]
    each = size // (slice_.blocks * slice_.parts)
    pieces = [
        padded.narrow(slice_.dim, b * slice_.parts * each + index * each, each)
        for b in range(slice_.blocks)
    ]
    return torch.cat(pieces, dim=slice_.dim)


def stage_params(plan: Plan, gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[list[str]]:
    """Per stage, the canonical names of the parameters its nodes read, in order of first use."""
    canonical = canonical_names(model)
    stage_of = plan.stage_of()
    out: list[list[str]] = [[] for _ in range(plan.num_stages)]
    for node in gm.graph.nodes:
        # A get_attr is copied into every stage whose nodes read it.
        homes = {stage_of[u.name] for u in node.users} if node.op == "get_attr" else set()
        for name in params_of_node(node, gm):
            key = canonical.get(name, name)
            for stage in sorted(homes or {stage_of[node.name]}):
                if key not in out[stage]:
                    out[stage].append(key)
    return out


def zero3_owner(name: str, blocks: Blocks) -> str:
    """The ZeRO-3 unit a parameter belongs to: its block, as FSDP users wrap them.

    The unit of its module (compiler/blocks.py): the repeated block it sits in at any
    depth (`layers.3.attn.qkv.weight` -> `layers.3`, `model.layers.3.mlp.up.weight` ->
    `model.layers.3`), else the outermost module holding no block (`wte.weight` ->
    `wte`, `model.tok.weight` -> `model.tok`); a raw parameter of a module that holds
    blocks is a unit with that module's other raw ones. Gathering a block at once costs
    a few collectives per block instead of one per Linear (each a blocking round trip).
    """
    module = name.rpartition(".")[0]
    unit = blocks.unit_of(module)
    return module if unit is None else unit


def _pad(n: int, dp: int) -> int:
    return math.ceil(n / dp) * dp if n else 0


def _by_kind(
    bucket: list[tuple[str, int]], kind: Mapping[str, Hashable]
) -> list[list[tuple[str, int]]]:
    """A bucket's parameters as one unit per kind, each in the bucket's order: a model
    alternating weights with decay and biases without keeps a bucket's two flat buffers,
    not one per parameter."""
    out: dict[Hashable, list[tuple[str, int]]] = {}
    for name, numel in bucket:
        out.setdefault(kind.get(name), []).append((name, numel))
    return list(out.values())


def flat_units(
    params: list[tuple[str, int, str]],
    *,
    zero: int,
    dp: int,
    bucket_elems: int,
    solo: frozenset[str] = frozenset(),
    kinds: Mapping[str, Hashable] | None = None,
) -> tuple[FlatUnit, ...]:
    """Group (name, local numel, owner module) in order of first use into flat units.

    ZeRO-3: one unit per owner (`zero3_owner`) and kind, in order of use. Otherwise:
    buckets in reverse order of use, each closed once it reaches `bucket_elems`, then a
    unit per kind in it (`_by_kind`). A name in
    `solo` (a weight tied across stages) is a unit of its own, so every stage
    holding it lays it out the same way and their gradients can be summed. A unit
    is one flat buffer stepped as one tensor, so it holds one kind (`kinds`, name ->
    e.g. (dtype, optimizer group)): a bf16 Linear beside an fp32 norm lands in two
    units, never in a buffer of the other's dtype, and a bias without weight decay in
    another unit than its weight with it.
    """
    kind = dict(kinds or {})
    groups: list[list[tuple[str, int]]] = []
    if zero == 3:
        owners: dict[tuple[str, object], list[tuple[str, int]]] = {}
        for name, numel, owner in params:
            key = (f"solo:{name}" if name in solo else owner, kind.get(name))
            owners.setdefault(key, []).append((name, numel))
        groups = list(owners.values())
    else:
        current: list[tuple[str, int]] = []
        # As DDP: a small first bucket (the last layers' gradients, ready first) so
        # communication starts early in backward, then full-size buckets.
        limit = min(bucket_elems, FIRST_BUCKET_ELEMS)
        for name, numel, _ in reversed(params):
            if name in solo:
                groups.append([(name, numel)])
                continue
            current.append((name, numel))
            if sum(n for _, n in current) >= limit:
                groups += _by_kind(current, kind)
                current = []
                limit = bucket_elems
        if current:
            groups += _by_kind(current, kind)
    units = []
    for group in groups:
        numel = sum(n for _, n in group)
        padded = _pad(numel, dp)
        units.append(FlatUnit(tuple(n for n, _ in group), numel, padded, dp))
    return tuple(units)
