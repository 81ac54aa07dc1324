"""PyTorch's own mixed precision, the native side of bench/precision.py's cases.

Not a benchmark itself (run_all.py skips files whose name starts with `_`).

    case    fp32                                bf16 (fp32 parameters stay the masters)
    DP      DDP (gradient_as_bucket_view)       forward under torch.autocast (bf16 matmuls,
                                                fp32 params and grads); `reduce bf16`:
                                                + a comm hook all-reducing in bf16
    ZeRO-3  FSDP2 fully_shard, every block      MixedPrecisionPolicy(param_dtype=bf16,
            then the root                       reduce_dtype=fp32 or bf16), no autocast
    TP      DTensor parallelize_module          under torch.autocast
            (bench/tp.py's GPT plan)
    PP      PipelineStage + Schedule1F1B        each stage's forward under torch.autocast
            (bench/pp.py's stage modules)

Every side computes the loss in fp32 from upcast logits (`logits.float()`), as
parc's `precision bf16` does, and returns the global mean loss of the step.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT

MODEL = ROOT / "examples" / "gpt.py"
LR = 3e-4

__all__ = ["LR", "MODEL", "Case", "Mode", "Size", "build_native", "source"]


class Mode(str, Enum):
    """A training run's number formats: its compute and its gradient reduction."""

    FP32 = "fp32"
    BF16 = "bf16"  # parc's default reduce under bf16: gradients reduced in bf16
    BF16_REDUCE_FP32 = "bf16, reduce fp32"

    @property
    def bf16(self) -> bool:
        return self is not Mode.FP32

    @property
    def spec(self) -> str:
        """The .par lines that ask parc for this mode."""
        return {
            Mode.FP32: "",
            Mode.BF16: "precision bf16\n",
            Mode.BF16_REDUCE_FP32: "precision bf16\nreduce fp32\n",
        }[self]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is Mode.BF16 else torch.float32


class Case(str, Enum):
    DP = "DP"
    ZERO3 = "ZeRO-3"
    TP = "TP"
    PP = "PP"


@dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    """The model (examples/gpt.py's environment variables), the batch and the step counts."""

    env: dict[str, str]
    batch: int  # global
    split: int  # PP: blocks [0, split) on stage 0
    microbatches: int  # PP
    warmup: int
    steps: int  # timed, after the warm-up


def source(size: Size) -> Any:
    os.environ.update(size.env)  # examples/gpt.py reads its size when building
    from parc.compiler.model import load_model

    return load_model(str(MODEL))


def _adamw(params: Any) -> Any:
    return torch.optim.AdamW(params, lr=LR)


def _autocast(on: bool) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _mean_over_ranks(total: float, count: int) -> float:
    t = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / count


def _seeded_model(src: Any) -> Any:
    torch.manual_seed(0)  # parc.compile builds from the same seed
    return src.build()


def _bf16_all_reduce(group: Any, bucket: Any) -> Any:
    """A DDP comm hook: the bucket cast to bf16, divided by the world and all-reduced in
    bf16, cast back into the fp32 bucket (as torch's bf16_compress_hook, which DDP allows
    only on NCCL / XCCL)."""
    flat = bucket.buffer()
    world = dist.get_world_size(group)
    low = flat.to(torch.bfloat16).div_(world)
    work = dist.all_reduce(low, group=group, async_op=True)

    def unpack(done: Any) -> torch.Tensor:
        return flat.copy_(done.value()[0])

    return work.get_future().then(unpack)


# DDP checks a hook's annotations as objects; this module's are strings (postponed).
_bf16_all_reduce.__annotations__ = {
    "group": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class _DataParallel:
    """DDP (DP) or FSDP2 (ZeRO-3) over every rank; each rank runs its slice of the batch."""

    def __init__(self, case: Case, mode: Mode, size: Size) -> None:
        src = source(size)
        self.loss_fn = src.loss_fn
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = _seeded_model(src)
        self.autocast = mode.bf16 and case is Case.DP  # FSDP2 casts the parameters instead
        if case is Case.ZERO3:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if mode.bf16 else None,
                reduce_dtype=mode.reduce_dtype if mode.bf16 else None,
            )
            mesh = init_device_mesh("cpu", (self.world,))
            for block in model.layers:  # as torchtitan: each block, then the root
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            self.model = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, gradient_as_bucket_view=True)
            if mode is Mode.BF16:  # the fp32 buckets all-reduced as bf16
                self.model.register_comm_hook(None, _bf16_all_reduce)
        self.opt = _adamw(self.model.parameters())

    def step(self, x: Any, y: Any) -> float:
        per = x.shape[0] // self.world
        x, y = (
            x[self.rank * per : (self.rank + 1) * per],
            y[self.rank * per : (self.rank + 1) * per],
        )
        self.opt.zero_grad()
        with _autocast(self.autocast):
            logits = self.model(x)
        loss = self.loss_fn(logits.float(), y)
        loss.backward()
        self.opt.step()
        return _mean_over_ranks(float(loss.detach()), self.world)


def _tensor_parallel(mode: Mode, size: Size) -> Any:
    """bench/tp.py's DTensor side on this bench's model, its forward under autocast for bf16."""
    import tp

    class TensorParallel(tp._Native):
        def __init__(self) -> None:
            super().__init__(dataclasses.replace(tp.PAIRS[0], env=size.env, batch=size.batch))

        def step(self, x: Any, y: Any) -> float:
            self.opt.zero_grad()
            with _autocast(mode.bf16):
                logits = self.model(x)
            loss = self.loss_fn(logits.float(), y)  # every rank holds the whole batch and loss
            loss.backward()
            self.opt.step()
            return float(loss.detach())

    return TensorParallel()


class _Autocast(torch.nn.Module):
    """`inner`'s forward under torch.autocast (bf16): a pipeline stage's module."""

    def __init__(self, inner: torch.nn.Module, on: bool) -> None:
        super().__init__()
        self.inner, self.on = inner, on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(self.on):
            return self.inner(x)


class _Pipeline:
    """torch.distributed.pipelining: bench/pp.py's stage module of this rank, Schedule1F1B."""

    def __init__(self, mode: Mode, size: Size) -> None:
        import pp
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        src = source(size)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.microbatches = size.microbatches
        stage = pp._stage_module(_seeded_model(src), self.rank, size.split)
        module = _Autocast(stage, mode.bf16)
        self.stage = PipelineStage(module, self.rank, self.world, torch.device("cpu"))

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return src.loss_fn(logits.float(), y)

        self.schedule = Schedule1F1B(self.stage, n_microbatches=self.microbatches, loss_fn=loss_fn)
        self.model = module
        self.opt = _adamw(module.parameters())

    def step(self, x: Any, y: Any) -> float:
        self.opt.zero_grad()
        losses: list[Any] = []
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
        else:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        self.opt.step()
        # As parc: the last stage's microbatch losses, summed over ranks.
        return _mean_over_ranks(sum(float(v) for v in losses), self.microbatches)


def build_native(case: Case, mode: Mode, size: Size) -> Any:
    """The native implementation of `case` in `mode`: `.step(x, y) -> loss`; `.model` and
    `.opt` for the memory walk."""
    if case in (Case.DP, Case.ZERO3):
        return _DataParallel(case, mode, size)
    if case is Case.TP:
        return _tensor_parallel(mode, size)
    return _Pipeline(mode, size)
