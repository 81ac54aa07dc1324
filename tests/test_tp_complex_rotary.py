"""Complex rotary embeddings (torchtitan's form) on head-sharded q and k stay local.

torchtitan applies rotary embeddings as complex numbers: q [bs, seqlen, heads,
head_dim] is viewed as [bs, seqlen, heads, head_dim / 2] complex values
(`view_as_complex` of its (even, odd) pairs), multiplied by a replicated
`freqs_cis` table (made with `torch.polar`) that broadcasts over batch and
heads, and viewed back (`view_as_real`, `flatten(3)`). Under a Megatron plan q
and k arrive sharded by heads; each rank rotates its own heads, so nothing is
gathered. A shard on the dim the pairs live on (the last, of size 2) cannot
stay: it is all-gathered, with a warning, and trains as one device.

The model is tests/models/titan_style.py (torchtitan's style, parc's convention).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import check_equivalent

from parc.compiler.cost import node_costs
from parc.compiler.frontend import Analysis, analyse
from parc.compiler.node_meta import meta_of
from parc.compiler.ops.collectives import CommKind, comm_activated
from parc.compiler.passes.placement import Shard
from parc.compiler.passes.tensor_parallel import tensor_parallel

TITAN = str(Path(__file__).resolve().parent / "models" / "titan_style.py")
MEGATRON = """
shard *.attention.wq col tp
shard *.attention.wk col tp
shard *.attention.wv col tp
shard *.attention.wo row tp
shard *.feed_forward.w1 col tp
shard *.feed_forward.w3 col tp
shard *.feed_forward.w2 row tp
"""
# TITAN_ROTARY: tests/models/titan_style.py's fx-traceable rotary code, or torchtitan's own.
ROTARY_FORMS = ["fx", "torchtitan"]
HEADS_DIM = 2  # q and k are [bs, seqlen, heads, head_dim (/ 2 complex)]: sharded by heads


def _env(
    monkeypatch: pytest.MonkeyPatch, heads: int = 4, kv_heads: int = 2, rotary: str = "fx"
) -> dict[str, str]:
    env = {
        "TITAN_ROTARY": rotary,  # "torchtitan": its exact code, captured with torch.export
        "TITAN_DIM": str(8 * heads),  # head_dim 8: 4 complex pairs per head
        "TITAN_LAYERS": "2",
        "TITAN_HEADS": str(heads),
        "TITAN_KV_HEADS": str(kv_heads),
        "TITAN_VOCAB": "64",
        "TITAN_SEQ": "8",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _gathers(analysis: Analysis) -> int:
    return sum(
        c.count for _, comms in analysis.estimate.collectives for c in comms
        if c.kind == CommKind.ALL_GATHER
    )  # fmt: skip


def _gathers_at(node: torch.fx.Node) -> bool:
    return CommKind.ALL_GATHER in dict(meta_of(node).collectives)


def _complex_views(analysis: Analysis) -> list[torch.fx.Node]:
    views = (torch.view_as_complex, torch.view_as_real)
    return [n for n in analysis.gm.graph.nodes if n.target in views]


@pytest.mark.parametrize("rotary", ROTARY_FORMS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp"),
    [(4, 4, 2), (4, 2, 2), (8, 4, 4)],
    ids=["mha-tp2", "gqa-tp2", "gqa-tp4"],
)
def test_head_sharded_complex_rotary_gathers_nothing(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, tp: int, rotary: str
) -> None:
    _env(monkeypatch, heads, kv_heads, rotary)
    analysis = analyse(f"mesh tp={tp}\n{MEGATRON}", TITAN, batch=2)
    assert not analysis.plan.warnings, [w.message for w in analysis.plan.warnings]
    assert _gathers(analysis) == 0
    views = _complex_views(analysis)
    assert len(views) == 2 * 2 * 2  # q and k, in and out, 2 layers
    for node in views:
        assert meta_of(node).tp == Shard(HEADS_DIM), node.format_node()
    assert not [n.format_node() for n in analysis.gm.graph.nodes if _gathers_at(n)]


class _ShapeComm:
    """A tp axis of 2 seen from rank 1, for running one rank's program on `meta`: sums
    are left as they are (values are not checked, shapes are) and nothing may gather."""

    rank, step = 1, None

    def size(self, axis: str) -> int:
        return 2

    def index(self, axis: str) -> int:
        return 1

    def all_reduce(self, t: torch.Tensor, axis: str, *, async_op: bool = False) -> None:
        return None

    def all_gather(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the rank program all-gathers")

    reduce_scatter = all_gather


class _Shapes(torch.fx.Interpreter):
    """Runs a graph, recording the shape of every complex view it computes."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.shapes: list[tuple[int, ...]] = []

    def run_node(self, n: torch.fx.Node) -> object:
        out = super().run_node(n)
        if n.target is torch.view_as_complex:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("rotary", ROTARY_FORMS)
def test_the_rank_program_rotates_its_own_heads_with_local_sizes(
    monkeypatch: pytest.MonkeyPatch, rotary: str
) -> None:
    _env(monkeypatch, rotary=rotary)
    analysis = analyse(f"mesh tp=2\n{MEGATRON}", TITAN, batch=2)
    rank = tensor_parallel(analysis.gm, analysis.plan, tp_index=1).to("meta")
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    run = _Shapes(rank)
    with comm_activated(_ShapeComm()):
        logits = run.run(tokens)
    # Every size argument is local, or a view would fail: q [bs, seqlen, heads,
    # head_dim / 2] complex with 2 of the 4 q heads on the rank, k with 1 of 2.
    assert run.shapes == [(2, 8, 2, 4), (2, 8, 1, 4)] * 2
    assert tuple(logits.shape) == (2, 8, 64)


def test_complex_views_cost_no_flops_and_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch)
    analysis = analyse("mesh dp=1\n", TITAN, batch=2)
    costs = node_costs(analysis.gm)
    views = _complex_views(analysis)
    assert views and all(costs[n.name].flops == costs[n.name].ops == 0 for n in views)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("rotary", ROTARY_FORMS)
@pytest.mark.parametrize(
    "mesh",
    ["mesh tp=2", "mesh dp=2 tp=2", "mesh pp=2 tp=2\nstage auto\nmicrobatches 2"],
    ids=["tp2", "dp2-tp2", "pp2-tp2"],
)
def test_titan_style_megatron_plan_trains_as_one_device(
    gloo_pool, monkeypatch: pytest.MonkeyPatch, mesh: str, rotary: str
) -> None:
    # GQA: 4 q heads share 2 kv heads, and tp=2 divides the kv heads.
    env = _env(monkeypatch, rotary=rotary)
    comparison, _ = check_equivalent(gloo_pool, f"{mesh}\n{MEGATRON}", TITAN, env=env)
    assert comparison.ok, comparison


_SMALL_MODEL = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
{forward}

def build_model():
    return Net()


def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 16, generator=g)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def configure_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""
# The col layer's output viewed so that its shard lands on the pairs' dim.
_PAIRS_SHARDED = """
        angles = torch.arange(8.0) / 8
        self.register_buffer("freqs", torch.polar(torch.ones(8), angles), persistent=False)

    def forward(self, x):
        b = x.shape[0]
        pairs = self.up(x).view(b, 2, 8).transpose(1, 2).contiguous()  # [b, 8, 2], S(2)
        z = torch.view_as_complex(pairs) * self.freqs
        return torch.view_as_real(z).transpose(1, 2).reshape(b, 16)
"""
# Angles from a col layer made complex with polar (the radii sliced locally), the
# pairs flattened back into the row layer's input. (Each model adds to __init__.)
_POLAR_SHARDED = """
        self.down = nn.Linear(32, 16, bias=False)
        self.register_buffer("radius", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x):
        z = torch.polar(self.radius, self.up(x))  # [b, 16] complex, S(1)
        return self.down(torch.view_as_real(z).flatten(-2))  # [b, 32], S(1)
"""
POLAR_SPEC = "mesh tp=2\nshard up col tp\nshard down row tp\n"


def _model(tmp_path: Path, forward: str) -> str:
    path = tmp_path / "complex_net.py"
    path.write_text(_SMALL_MODEL.format(forward=forward))
    return str(path)


def _pairs_model(tmp_path: Path) -> str:
    return _model(tmp_path, _PAIRS_SHARDED)


def test_polar_of_sharded_angles_stays_sharded(tmp_path: Path) -> None:
    analysis = analyse(POLAR_SPEC, _model(tmp_path, _POLAR_SHARDED), batch=2)
    assert not analysis.plan.warnings, [w.message for w in analysis.plan.warnings]
    assert _gathers(analysis) == 0
    (polar,) = (n for n in analysis.gm.graph.nodes if n.target is torch.polar)
    assert meta_of(polar).tp == Shard(1)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_polar_of_sharded_angles_trains_as_one_device(gloo_pool, tmp_path: Path) -> None:
    model = _model(tmp_path, _POLAR_SHARDED)
    comparison, _ = check_equivalent(gloo_pool, POLAR_SPEC, model, env={})
    assert comparison.ok, comparison


def test_a_shard_on_the_pairs_dim_is_gathered_with_a_warning(tmp_path: Path) -> None:
    analysis = analyse("mesh tp=2\nshard up col tp\n", _pairs_model(tmp_path), batch=2)
    (warning,) = analysis.plan.warnings
    assert "`view_as_complex()`" in warning.message
    assert "placed S(2) (sharded by 'up'): it is all-gathered first" in warning.message
    (node,) = (n for n in analysis.gm.graph.nodes if n.target is torch.view_as_complex)
    assert _gathers_at(node)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_shard_on_the_pairs_dim_trains_as_one_device(gloo_pool, tmp_path: Path) -> None:
    spec = "mesh tp=2\nshard up col tp\n"
    comparison, _ = check_equivalent(gloo_pool, spec, _pairs_model(tmp_path), env={})
    assert comparison.ok, comparison
