"""Ready for NCCL, checked without a GPU (issue 14, item 3).

- Backend and device follow the live process group: NCCL puts a rank on
  ``cuda:LOCAL_RANK`` and makes it the current device (a user's own torchrun
  loop calls only `parc.compile`); gloo keeps a rank on the CPU even on a GPU
  machine. The machine is faked by patching `torch.cuda.is_available`,
  `device_count` and `set_device`: no CUDA call is made.
- The worker pool (and so `parc check`) takes NCCL only with a GPU per rank,
  each rank on its own.
- No CPU tensor reaches a collective: a static audit of every collective call
  in runtime/ and compiler/ops/ (each audited site with why its tensors live on
  the rank's device), and of every tensor made there without a device. A CPU
  run cannot show a device mismatch (every tensor is on the CPU), so the audit
  is what fails when a new collective or a device-less tensor appears.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parc.compiler.plan import MeshPlan
from parc.errors import RuntimeFault
from parc.runtime import mesh
from parc.testing import pool_rank

ROOT = Path(__file__).resolve().parent.parent


def _pretend_gpus(count: int, set_device: list[Any]) -> dict[str, Any]:
    """Patch torch.cuda into a machine with `count` GPUs; the originals, to restore."""
    saved = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}
    saved["set_device"] = torch.cuda.set_device
    torch.cuda.is_available = lambda: count > 0  # type: ignore[assignment]
    torch.cuda.device_count = lambda: count  # type: ignore[assignment]
    torch.cuda.set_device = set_device.append  # type: ignore[assignment]
    return saved


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`gpus(count)` fakes the machine for the test; the set_device calls it records."""
    calls: list[Any] = []

    def fake(count: int) -> list[Any]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", calls.append)
        return calls

    yield fake


def test_without_a_process_group_a_gpu_machine_means_nccl_on_the_local_rank_gpu(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not dist.is_initialized()
    gpus(4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert mesh.backend() == "nccl"
    assert mesh.device_for_rank() == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert mesh.device_for_rank() == torch.device("cuda", 0)  # rank 0 of no group


def test_build_comm_makes_the_local_rank_gpu_current(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # parc.compile in a user's own torchrun loop: nothing else calls set_device there.
    calls = gpus(8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    comm = mesh.build_comm(MeshPlan((("dp", 1),)))
    assert calls == [torch.device("cuda", 3)]
    assert comm.coords == {"dp": 0}


def test_on_a_cpu_machine_nothing_touches_cuda(gpus: Any) -> None:
    calls = gpus(0)
    mesh.build_comm(MeshPlan((("dp", 1),)))
    assert (mesh.backend(), mesh.device_for_rank(), calls) == ("gloo", torch.device("cpu"), [])


def gloo_rank_on_a_gpu_machine() -> tuple[str, str, list[Any]]:
    """Pool case: backend, device and set_device calls of a gloo rank that sees 2 GPUs."""
    calls: list[Any] = []
    saved = _pretend_gpus(2, calls)
    try:
        mesh.build_comm(MeshPlan((("dp", 2),)))
        return mesh.backend(), str(mesh.device_for_rank()), calls
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


@pytest.mark.multiprocess
def test_a_gloo_world_computes_on_the_cpu_even_on_a_gpu_machine(gloo_pool: Any) -> None:
    # gloo's CUDA collectives lack reduce-scatter, all-gather into a tensor and
    # send/recv: a gloo rank must not put its program on cuda:0.
    results = gloo_pool(2).run(gloo_rank_on_a_gpu_machine)
    assert results == [("gloo", "cpu", []), ("gloo", "cpu", [])]


def test_the_pool_takes_nccl_only_with_a_gpu_for_every_rank(gpus: Any) -> None:
    gpus(2)
    assert [mesh.local_backend(n) for n in (1, 2, 3)] == ["nccl", "nccl", "gloo"]
    gpus(0)
    assert mesh.local_backend(1) == "gloo"


def test_parc_check_counts_cpu_ranks_when_its_pool_falls_back_to_gloo(gpus: Any) -> None:
    gpus(1)
    # Four ranks on a one-GPU machine: the pool runs gloo on the CPU, so it may.
    mesh.check_local_ranks(4, backend_name=mesh.local_backend(4))
    with pytest.raises(RuntimeFault, match="one rank per GPU and this node has 1"):
        mesh.check_local_ranks(4, backend_name="nccl")


def test_a_pool_rank_of_an_nccl_world_takes_its_own_gpu(
    gpus: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = gpus(4)
    joined: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        pool_rank.dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw))
    )
    monkeypatch.setenv("LOCAL_RANK", "0")  # restored after the test
    spec = pool_rank.RankSpec(
        rank=3,
        world_size=4,
        backend="nccl",
        timeout=5.0,
        store=tmp_path / "store",
        log=tmp_path / "log",
        stack=tmp_path / "stack",
    )
    pool_rank.join_world(spec)
    assert calls == [3]
    assert os.environ["LOCAL_RANK"] == "3"
    assert mesh.device_for_rank() == torch.device("cuda", 3)
    assert [(b, kw["rank"], kw["world_size"]) for b, kw in joined] == [("nccl", 3, 4)]


# ------------------------------------------------------------------ static audit

_COLLECTIVES = {
    "all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "reduce_scatter",
    "all_gather_into_tensor", "all_gather_single", "reduce_scatter_single", "isend",
    "irecv", "send", "recv", "batch_isend_irecv", "P2POp", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
    "barrier",
}  # fmt: skip
_FLAT = {"all_gather_flat", "reduce_scatter_flat"}  # collectives.py's aliases
_MAKERS = {
    "tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn",
    "randint", "eye", "linspace",
}  # fmt: skip

# Every collective call site, and why the tensors it is given live on the rank's device.
AUDITED = {
    ("runtime/collectives.py", "Comm.all_reduce"): "gradient buckets and tp ops: device",
    ("runtime/collectives.py", "Comm.all_gather"): "ZeRO shards and tp ops: device",
    ("runtime/collectives.py", "Comm.reduce_scatter"): "gradient buckets, ZeRO: device",
    ("runtime/collectives.py", "Comm.post_p2p"): "activations, and buffers on self.device",
    ("runtime/collectives.py", "Comm.metric_sum"): "evaluate's and shares' sums: device",
    # Under gloo on the CPU only (MetricSum._rows is None elsewhere): the all-reduce of
    # Program._global_loss's device tensor, or point-to-point sends and receives of it.
    ("runtime/metric_exchange.py", "MetricSum.__init__"): "rows made on `device`",
    ("runtime/metric_exchange.py", "MetricSum.total"): "Program._global_loss, device tensor",
    ("runtime/metrics.py", "gather_max"): "step time and peak memory, a tensor on `device`",
    ("runtime/program.py", "Program._tied_reduce"): "a parameter's gradient: device",
    ("runtime/nonfinite.py", "first_nonfinite_param"): "index made on parts.device",
    # runtime/gather.py's state tensors and eval_mode.replica_zero_buffers' live buffers:
    # moved or made on parts.device.
    ("runtime/collectives.py", "Comm.broadcast"): "state and buffers on parts.device",
    # Zero3.full_local and GradSync.full_local (bf16 masters): `out` on the shard's device.
    ("runtime/master_weights.py", "assemble_from_shards"): "views of a shard-device tensor",
    # Object collectives pickle on the current device: build_comm makes it this rank's.
    ("runtime/checkpoint/integrity.py", "record_manifest"): "objects",
    ("runtime/checkpoint/integrity.py", "verify_files"): "objects",
    ("runtime/checkpoint/store.py", "_barrier"): "no tensor",
    # Graph ops through compiler/ops/traceable.py, whose outputs are made on the input's
    # device: the tp ops' activations and gradients, device tensors.
    ("compiler/ops/collectives.py", "_gather_dim"): "a tp op's activation: device",
    ("compiler/ops/collectives.py", "_scatter_dim"): "a tp op's partial sums: device",
    ("compiler/ops/vocab.py", "_VocabCrossEntropy.forward"): "logits' statistics: device",
    ("runtime/materialise.py", "_first_problem"): "objects",
    ("runtime/eval_mode.py", "refuse_baked"): "objects",
    # Only where the pp ops progress each on their own (gloo on the CPU), never NCCL.
    ("runtime/local_p2p.py", "LocalLinks.between"): "objects",
}

# Tensors made without a device in these files, and why none reaches a collective.
HOST_TENSORS = {
    ("runtime/local_link.py", "_Ring.bytes"): "an empty message's bytes; links exist only "
    "where collectives run on the CPU (gloo), never beside NCCL",
    ("runtime/check.py", "_check_optimizer"): "a probe parameter, in the owner process",
    ("runtime/checkpoint/optim.py", "OptimizerLoad._scalar"): "an optimizer step count: "
    "torch keeps it on the CPU; filled by DCP's reads, not by a collective",
    ("runtime/probes.py", "nudge_outputs.nudge"): "the reference run's noise, one process",
    ("runtime/schedules.py", "check_lr_followed"): "a probe parameter for the model's "
    "scheduler before launch, on the launcher's host",
    ("runtime/schedules.py", "check_schedule"): "a probe parameter for the model's "
    "configure_scheduler, in the launcher before any world",
    # A rank's data is made on the host, as a DataLoader's is: Program.step_local moves
    # its share to the rank's device before any compute or collective reads it.
    ("runtime/data.py", "DataStream._checked"): "a batch check's probe, on the host data",
    ("runtime/text_data.py", "TextData.__call__"): "the rank's window indices (host data)",
    ("runtime/text_data.py", "TextData._batches"): "window offsets into the host tokens",
    ("runtime/text_data.py", "_encode"): "token ids of the text file, host data",
    ("runtime/text_data.py", "_tokens"): "the text file's token stream, host data",
    # Program._global_loss copies the 0-d hash into its metric tensor on the device.
    ("runtime/same_batch.py", "batch_fingerprint"): "the host batch's hash, a 0-d tensor",
    ("runtime/same_batch.py", "_weights"): "the hash's weights, multiplied with host data",
}


class _Calls(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.collectives: set[str] = set()
        self.host_tensors: set[str] = set()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Call(self, node: ast.Call) -> None:
        where, f = ".".join(self.scope), node.func
        if isinstance(f, ast.Name) and f.id in _FLAT:
            self.collectives.add(where)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id == "dist" and f.attr in _COLLECTIVES:
                self.collectives.add(where)
            devices = [k for k in node.keywords if k.arg == "device"]
            if f.value.id == "torch" and f.attr in _MAKERS and not devices:
                self.host_tensors.add(where)
        self.generic_visit(node)


def _audit() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    collectives, host = set(), set()
    for path in sorted([*ROOT.glob("runtime/**/*.py"), *ROOT.glob("compiler/ops/*.py")]):
        calls = _Calls()
        calls.visit(ast.parse(path.read_text()))
        rel = path.relative_to(ROOT).as_posix()
        collectives |= {(rel, where) for where in calls.collectives}
        host |= {(rel, where) for where in calls.host_tensors}
    return collectives, host


def test_every_collective_call_site_is_audited_for_device_tensors() -> None:
    found, _ = _audit()
    new, gone = found - set(AUDITED), set(AUDITED) - found
    assert not new, f"collective calls nobody audited for NCCL (add them to AUDITED): {new}"
    assert not gone, f"AUDITED names call sites that no longer exist: {gone}"


def test_no_tensor_is_made_off_the_device_where_collectives_run() -> None:
    _, found = _audit()
    new, gone = found - set(HOST_TENSORS), set(HOST_TENSORS) - found
    assert not new, (
        f"tensors made without device= (on the CPU; NCCL reduces none): {new}; give them "
        "the rank's device, or add them to HOST_TENSORS with the reason none reaches NCCL"
    )
    assert not gone, f"HOST_TENSORS names sites that no longer exist: {gone}"
