"""What the planner knows about a model, from one trace on the `meta` device.

`profile_model(source, gpus_per_node=8)` builds nothing at full size: the model
is built on `meta`, traced once, and one fake forward at micro-batch 1 records
shapes and saved tensors (compiler/saved.py). Every candidate spec is then
costed from these per-unit numbers (search.py), without tracing again.

Algorithm:
1. Build on meta, trace, run the fake forward at micro-batch 1 (`seq` slices
   the sample's dim 1).
2. Units (compiler/blocks.py, the finder ZeRO-3 uses too), in forward order:
   each repeated block at any depth (`layers.<i>`, `model.layers.<i>`), and
   the outermost modules holding no block (`tok`, `model.norm`, `lm_head`); a
   node outside every unit joins the unit before it. Pipeline stages are runs
   of units; `recompute` recomputes the blocks.
3. Tensor-parallel layout (Megatron's pairs, found in the dataflow): a Linear
   inside a block is `row` when every Linear whose output reaches its input
   (without passing another Linear) is `col`, else `col`: q, k, v → o and
   gate, up → down; fc1 → fc2.
4. For every tensor-parallel size (a divisor of the GPUs of a node): resolve
   a spec with those shard lines and run the tensor-parallel analysis; a
   ParcError is why that size cannot work. Per unit at one rank: local
   parameter elements, forward FLOPs, saved bytes, the bytes a recomputed
   block keeps (its inputs), collectives.
5. The bytes a pipeline cut after each unit sends forward (at the profile's dtypes).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import torch
import torch.fx

from parc.dsl import anchored_names
from parc.dsl.ast import Precision
from parc.errors import ParcError

from ..blocks import find_blocks
from ..host_memory import HostFacts, host_facts
from ..memory_model import MemoryModel, built_dtype, memory_model_for
from ..model import ModelSource
from ..model_output import input_tensors
from ..saved import compute_dtype, profile_forward
from ..trace import trace_model
from .profile_units import profile_units, recompute_patterns, sample_inputs, sequence_length
from .shard_layout import SEQUENCE_LINE, analyse_lines, megatron_layout, vocab_lines
from .shard_layout import shard_lines as blocks_lines
from .unit_costs import TPProfile, UnitCost, UnitCostModel

__all__ = ["ModelProfile", "TPProfile", "UnitCost", "profile_model"]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-unit costs at every feasible tensor-parallel size, and why others are not."""

    path: str
    units: tuple[str, ...]
    blocks: tuple[bool, ...]
    recompute_patterns: tuple[str, ...]  # `layers[*]` (`model.layers[*]`) per list of blocks
    params: int  # parameter elements of the whole model
    tokens: int  # elements of the first input per sample (the sequence length of an LM)
    tp: dict[int, TPProfile]
    rejected_tp: dict[int, str]
    host: HostFacts  # for the host memory of compiling (compiler/host_memory.py)
    precision: Precision = Precision.FP32
    """The precision the fake forward ran at: saved bytes and message dtypes are its."""
    vocab: dict[int, TPProfile] = field(default_factory=dict)
    """Per tp size, the model with its embedding and LM head vocab-parallel as well (loss
    parallel with the default loss): shard_layout.vocab_lines added to the blocks' lines."""
    sequence: dict[int, TPProfile] = field(default_factory=dict)
    """Per tp size, `sequence_parallel tp` added to those (where the analysis takes it)."""
    frozen: bool = False
    """The model has frozen parameters (requires_grad=False), which `zero 3` refuses."""
    built: torch.dtype | None = None  # its parameters' dtype when not float32 (built_dtype)
    anchored: tuple[str, ...] = ()  # units written from the root in stage lines (Plan.anchored)
    memory: MemoryModel = MemoryModel()
    """Bytes per parameter element at `precision` with the model's optimizer, the one
    configure_optimizer made in the profile's one call of it (`UnitCostModel`)."""


def profile_model(
    source: ModelSource,
    *,
    gpus_per_node: int = 8,
    seq: int | None = None,
    precision: Precision = Precision.FP32,
) -> ModelProfile:
    """Steps 1-5 (see the module docstring); shapes, dtypes and saved bytes are those
    of a run at `precision` (compiler/saved.py)."""
    enabled = gc.isenabled()
    gc.disable()  # many long-lived fx objects: see compiler/frontend.py
    try:
        return _profile(source, gpus_per_node, seq, precision)
    finally:
        if enabled:
            gc.enable()


def _profile(
    source: ModelSource, gpus_per_node: int, seq: int | None, precision: Precision
) -> ModelProfile:
    # Step 1
    torch.manual_seed(0)
    model = source.build(device="meta")
    inputs, own = sample_inputs(source, seq)
    native = sequence_length(source.batch(1, 0)[0])
    compute = compute_dtype(precision)
    gm = trace_model(model, inputs, own_loss=own, file=source.path, compute=compute)
    saved = profile_forward(gm, input_tensors(inputs), precision)
    # Step 2
    found = find_blocks(model)
    unit_of, units = profile_units(gm, found)
    blocks = tuple(u in found.blocks for u in units)
    # Step 3
    layout = megatron_layout(gm, unit_of, set(u for u, b in zip(units, blocks) if b))
    shard_lines = blocks_lines(layout, model, found)
    # Steps 4 and 5
    base = UnitCostModel(gm, model, saved, unit_of, units, found, source)
    profiles, rejected, vocab_profiles, sequence = _tp_profiles(
        base, shard_lines, gpus_per_node, native
    )
    xs = input_tensors(inputs)
    first = xs[0] if isinstance(xs[0], torch.Tensor) else torch.zeros(1)
    return ModelProfile(
        path=source.path,
        units=tuple(units),
        blocks=blocks,
        recompute_patterns=recompute_patterns(units, blocks),
        params=sum(p.numel() for p in model.parameters()),
        tokens=max(1, first.numel()),
        tp=profiles,
        rejected_tp=rejected,
        host=host_facts(model, gm, base.unit),
        precision=precision,
        vocab=vocab_profiles,
        sequence=sequence,
        frozen=any(not p.requires_grad for p in model.parameters()),
        built=built_dtype(model),
        anchored=anchored_names(units, dict(model.named_modules())),
        memory=memory_model_for(base.optimizer, precision, built=built_dtype(model)),
    )


def _tp_profiles(
    base: UnitCostModel, shard_lines: tuple[str, ...], gpus_per_node: int, native: int
) -> tuple[dict[int, TPProfile], dict[int, str], dict[int, TPProfile], dict[int, TPProfile]]:
    """Steps 4 and 5 at every tp size dividing a node: the block layout's profiles, the
    sizes it cannot split and why, and the vocab-parallel and sequence-parallel ones."""
    gm, model = base.gm, base.model
    profiles, rejected = {1: base.at(1, (), 0, None)}, {}
    vocab = vocab_lines(gm)
    vocab_profiles: dict[int, TPProfile] = {}
    sequence: dict[int, TPProfile] = {}
    for tp in (d for d in range(2, gpus_per_node + 1) if gpus_per_node % d == 0):
        if not shard_lines:
            rejected[tp] = "no Linear inside a repeated block to split"
            continue
        try:
            plan, warnings = analyse_lines(gm, model, shard_lines, tp)
        except ParcError as exc:
            rejected[tp] = exc.message
            continue
        profiles[tp] = base.at(tp, shard_lines, warnings, plan)
        variants = [(vocab_profiles, vocab)] if vocab else []
        # Sequence parallel splits the sequence the model file's batches have too (what
        # a spec's `# check:` line runs), not only the `--seq` it is planned at.
        if native % tp == 0:
            variants.append((sequence, (*vocab, SEQUENCE_LINE)))
        for into, extra in variants:
            with contextlib.suppress(ParcError):  # e.g. padded logits read sharded: not planned
                lines = shard_lines + extra
                plan, warnings = analyse_lines(gm, model, lines, tp, base.loss_parallel)
                into[tp] = base.at(tp, lines, warnings, plan)
    return profiles, rejected, vocab_profiles, sequence
