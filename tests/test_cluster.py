"""`--cluster` text, GPU presets, and the time model's per-axis links and ring formulas."""

from __future__ import annotations

import pytest

from parc.compiler.ops.collectives import CommKind
from parc.compiler.plan import MeshPlan
from parc.compiler.planner.cluster import GB, GIB, PRESETS, parse_cluster
from parc.compiler.planner.time_model import (
    StageSeconds,
    StepTime,
    axis_bandwidth,
    exposed_dp,
    wire_bytes,
)
from parc.errors import ParcError


@pytest.mark.parametrize(
    ("text", "nodes", "gpus", "mem", "intra", "inter"),
    [
        ("h100x8", 1, 8, 80 * GIB, 450 * GB, 50 * GB),
        ("h100", 1, 8, 80 * GIB, 450 * GB, 50 * GB),
        ("a100-80gx4", 1, 4, 80 * GIB, 300 * GB, 25 * GB),
        ("nodes=2 preset=h100", 2, 8, 80 * GIB, 450 * GB, 50 * GB),
        ("h100x8 nodes=4 inter=400Gb/s", 4, 8, 80 * GIB, 450 * GB, 50 * GB),  # bits
        (
            "nodes=4 gpus=8 mem=80GiB tflops=400 intra=450GB/s inter=50GB/s",
            4,
            8,
            80 * GIB,
            450 * GB,
            50 * GB,
        ),
        ("preset=rtx4090 gpus=2 mem=24GB", 1, 2, 24 * GB, 25 * GB, 12.5 * GB),  # GB: 10^9
    ],
)
def test_cluster_text(
    text: str, nodes: int, gpus: int, mem: int, intra: float, inter: float
) -> None:
    c = parse_cluster(text)
    assert (c.nodes, c.gpus, c.mem, c.intra, c.inter) == (nodes, gpus, mem, intra, inter)
    assert c.world == nodes * gpus
    assert c.budget == int(0.9 * mem)  # 10% left for the CUDA context and fragmentation


def test_every_preset_prints_what_it_holds() -> None:
    for name, preset in PRESETS.items():
        assert f"× 8 {name} (" in str(preset)
        assert parse_cluster(f"{name}x2").gpus == 2
    assert str(parse_cluster("nodes=2 preset=h100")) == (
        "2 nodes × 8 h100 (80.00 GiB, 400 TFLOP/s bf16), intra 450 GB/s, inter 50 GB/s"
    )


def test_a_small_memory_prints_in_its_own_unit() -> None:
    # `mem=2MiB` printed "0.00 GiB" (found by a probe).
    assert "(2.00 MiB, " in str(parse_cluster("nodes=1 preset=h100 mem=2MiB"))


def test_a_cluster_prints_as_text_that_parses_back() -> None:
    # `parc plan` writes this text into the spec's check command.
    for cluster in (
        *PRESETS.values(),
        parse_cluster("nodes=2 gpus=4 mem=24GB tflops=100 intra=64GB/s inter=12.5GB/s usable=0.8"),
    ):
        assert parse_cluster(cluster.text) == cluster, cluster.text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ("is empty",)),
        ("h10x8", ("unknown GPU 'h10'", "presets: h100", "did you mean 'h100'")),
        ("nodes=2 gpu=8 preset=h100", ("unknown key 'gpu'", "did you mean 'gpus'")),
        ("nodes=2", ("no preset and no mem, tflops, intra, inter", "add preset=NAME")),
        ("preset=h100 mem=80", ("mem=80: a size needs a unit", "e.g. mem=80GiB")),
        ("preset=h100 intra=450", ("intra=450: a bandwidth needs a unit per second",)),
        ("preset=h100 nodes=0", ("nodes=0: must be a whole number of at least 1",)),
        ("preset=h100 nodes=two", ("nodes=two: must be a whole number",)),
        ("preset=h100 tflops=fast", ("tflops=fast: not a number", "e.g. tflops=400")),
        ("preset=h100 usable=1.5", ("usable is a fraction of mem, at most 1; got 1.5",)),
        # nan and inf priced every step as 0 s ("nan TFLOP/s" in the report, exit 0)
        ("preset=h100 tflops=nan", ("tflops=nan: must be a finite number",)),
        ("preset=h100 fp32_tflops=inf", ("fp32_tflops=inf: must be a finite number",)),
        ("preset=h100 tflops=1e400", ("tflops=1e400: must be a finite number",)),
        ("preset=h100 usable=nan", ("usable=nan: must be a finite number",)),
    ],
)
def test_bad_cluster_text_says_what_and_how_to_fix(text: str, expected: tuple[str, ...]) -> None:
    with pytest.raises(ParcError) as info:
        parse_cluster(text)
    message = str(info.value)
    assert message.startswith(f"error: --cluster '{text}': "), message
    assert "hint: " in message
    for part in expected:
        assert part in message, message


# ----------------------------------------------------------------- the time model


def test_ring_collectives_move_these_bytes_per_rank() -> None:
    size = 1000.0
    assert wire_bytes(CommKind.ALL_REDUCE, 4, size) == 2 * 3 / 4 * size
    assert wire_bytes(CommKind.ALL_GATHER, 4, size) == 3 / 4 * size
    assert wire_bytes(CommKind.REDUCE_SCATTER, 8, size) == 7 / 8 * size
    assert wire_bytes(CommKind.SEND, 2, size) == size
    assert wire_bytes(CommKind.ALL_REDUCE, 1, size) == 0  # nothing to send to yourself


@pytest.mark.parametrize(
    ("axes", "inside"),
    [
        # 2 nodes × 8 GPUs, the last axis fastest: tp=8 is one node, pp spans both.
        ((("pp", 2), ("tp", 8)), {"pp": False, "tp": True}),
        ((("dp", 2), ("tp", 8)), {"dp": False, "tp": True}),
        # dp=4 × tp=2 fills one node; pp=2 goes across.
        ((("pp", 2), ("dp", 4), ("tp", 2)), {"pp": False, "dp": True, "tp": True}),
        # tp last but 16 wide: it cannot stay inside a node.
        ((("tp", 16),), {"tp": False}),
        # tp written first is the slowest axis: its groups stride over nodes.
        ((("tp", 2), ("dp", 8)), {"tp": False, "dp": True}),
    ],
)
def test_an_axis_is_inside_a_node_when_its_groups_are(
    axes: tuple[tuple[str, int], ...], inside: dict[str, bool]
) -> None:
    cluster = parse_cluster("nodes=2 preset=h100")
    mesh = MeshPlan(axes)
    for axis, expected in inside.items():
        bandwidth, found = axis_bandwidth(cluster, mesh, axis)
        assert found is expected, axis
        assert bandwidth == (cluster.intra if expected else cluster.inter)


def test_pipeline_time_has_p_minus_1_bubble_slots_per_round() -> None:
    stages = [StageSeconds(1.0, 0.1, 0.0), StageSeconds(2.0, 0.0, 0.5)]
    t = StepTime.of(stages, microbatches=4, grad_accum=2, dp=0.25)
    # The slowest stage (2.5 s a microbatch) runs 8 microbatches; each round waits 1 slot.
    assert (t.compute, t.tp, t.pp, t.bubble, t.dp) == (16.0, 0.0, 4.0, 2 * 2.5, 0.25)
    assert t.total == 16 + 4 + 5 + 0.25


def test_gradient_reduction_hides_behind_backward_but_zero3_gathers_do_not() -> None:
    assert exposed_dp(0, reduce=1.0, gather=0.0, backward=0.75) == 0.25
    assert exposed_dp(1, reduce=0.5, gather=0.5, backward=0.75) == 0.5  # the gather after
    assert exposed_dp(3, reduce=0.5, gather=1.0, backward=5.0) == 1.5
