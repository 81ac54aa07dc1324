"""`parc check`'s tolerances, calibrated by a noise twin of the reference run.

A fixed per-element tolerance cannot tell rounding from a bug under Adam: where
a gradient is near zero (a key bias, whose exact gradient is 0), a 1e-9
rounding difference flips the sign of a whole `lr` step, so a bound loose
enough for that passes every bug too (the old `atol = 5·lr·steps`). And Adam
is almost invariant to a constant gradient scale, so no bound on parameters
alone sees gradients averaged twice. The check therefore compares two things,
each against what rounding alone does to this model, optimizer and batch:

1. The gradients of step 0, gathered whole from the parallel run by one
   step of `GradientProbe` (an optimizer that writes each gradient into its
   parameter, through the same ZeRO shards, tp slices and stages), against
   the reference's. Any gradient bug (a missing all-reduce, a second 1/dp)
   shows here whatever the optimizer.
2. The parameters after the last step, and every step's loss.

The noise twin is the single-device reference run again with every batch in
reverse sample order and every module's output moved by one ulp up or down
(`nudge_outputs`): the same model on the same data, rounded differently where
layouts round differently (dp sums replica halves and microbatches
accumulate: other orders over the batch; tp splits matmuls and all-reduces
partial sums: other roundings of module outputs). Whatever training does to a
rounding difference (Adam's normalisation, momentum, growth over steps) it
does to the twin too, so one multiple of the twin's distance holds for every
optimizer and step count. Per tensor T (Euclidean norms over its elements):

    ‖parallel − reference‖ ≤ NOISE_MULT · ‖twin − reference‖ + floor · ‖reference‖
    loss at each step:  rel. diff ≤ LOSS_RTOL + NOISE_MULT · (the twin's rel. diff)

Measured (fp32, gloo, 2 cores; examples/mlp.py, a 2-layer examples/gpt.py and
examples/llama.py under dp=2, dp=2 zero 1 and zero 3, tp=2, pp=2 with 2
microbatches and dp=2 × tp=2; SGD and AdamW; 3 and 10 steps): a correct run is
at most 0.17 of its bound on every tensor (2.8× the twin's distance), and so
is one whose every gradient element moves one ulp every step
(`--inject-fault grad-ulp`). `skip-grad-sync` and `grad-scale` (a second 1/dp)
put step 0's gradients 1.2e5× or more past their bound, and the parameters
12× (AdamW, grad-scale) to 2e5× past it. NOISE_MULT = 16 leaves 6× over the
worst correct run. Batch reversal alone was not enough: under tp=2 with AdamW
a correct run was 25× its distance.

Every tensor (step 0's gradients, the final parameters) and every step's loss is
held to the twin's distance or to that of the split run (runtime/twins.py
`Variant.SPLIT`: each step's batch forward and backward in two halves, each loss
weighted by its share, as dp=2 and two microbatches sum them), whichever is
farther (runtime/calibrated_compare.py `_noise`). A gradient that nearly cancels
rounds by its terms, not by its value: BERT's 2-label classifier bias with
balanced labels is 3.7e-4 from terms of ~0.06, dp=2's halves move it 1.05e-8,
the twin moved it by nothing, and the floor (4·ε·‖T‖) is 2.5e-10, so a correct
run was 42× past its bound (a probe over 160 HF runs found it; every other run
stayed under 0.23). With the split it is 0.06, and `skip-grad-sync` / `grad-
scale` still fail it (tests/test_check_split_twin.py). Under Adam a near-zero
gradient whose rounding flips its sign steps a whole lr the other way: a 2-class
MLP with a near-zero head and balanced labels had its head bias 36× past the
twin's bound after 3 steps (AdamW lr 1e-2, dp=2); the split run flips it as dp's
halves do. The split is used only where it is a rounding twin at every step
(calibrated_compare.py `_split_rounds`): each step's loss within TWIN_GATE of
the reference's (a loss that is no mean over samples, uneven ignored targets or
samples that interact, BatchNorm, change it beyond rounding), and step 0's
gradients within NOISE_MULT times the twin's distance plus 1e-5 of their whole
norm. A loss averaged over counted targets, weighted by sample shares, is the
per-share objective a wrong parallel run computes; step 0 alone let it in where
step 0 could not tell (every token's loss ln V under a zero-initialised head, a
balanced first batch, one ignored target in 1024), and such runs were called
EQUIVALENT at the split's distance (found by two probes).

The floor covers tensors the twin reproduces bit for bit (LayerNorm weights
whose gradients sum in a fixed order): floor = 4·ε·(steps + 1), ε = 2⁻²³ the
fp32 machine epsilon: one ulp of difference per element per step, and of the
gradient, is at most ε·‖T‖ each (4× for rounding of the update itself).

If the twin itself moves step 0's loss by more than TWIN_GATE, the model's
output depends on the order of samples or on random draws (dropout): there is
no rounding-only distance to calibrate against, and the check says so instead
of passing anything. The gate reads the fp32 pair under every precision:
order dependence is the model's, and bf16 rounding alone moves a tiny MLP's
step-0 loss by 2e-3, past dropout's 1e-3.

Under `precision bf16` (`CALIBRATIONS`) the reference and its twin run the
mixed recipe of the parallel run (fp32 masters, bf16 compute copies, forward
under autocast), so the bounds measure parallelism, not precision:

- The twin is right for bf16 as it is: autocast makes module outputs bf16,
  so `nudge_outputs` moves each by one bf16 ulp (measured on examples/gpt.py:
  a median 2⁻⁷·⁵ of the value at the first module; bf16's rounding, 2⁻⁸ at
  most, is half an ulp, as fp32's one ulp is twice fp32's rounding).
- Floors: step 0's gradients are bf16 values (reduced in bf16, or the fp32 sum
  of each rank's bf16 gradients), so their floor takes bf16's ε = 2⁻⁷ (4·2⁻⁷ =
  0.031 of ‖T‖: one bf16 ulp per element); the parameters compared are the
  fp32 masters, whose floor keeps fp32's ε.
- Sign flips (`excuse_flips`): at bf16 a near-zero gradient element is within
  rounding of zero far more often, and Adam's first step moves it lr·sign(g):
  a whole 2·lr apart. Elements whose step-0 gradient has another sign in the
  twin or the parallel run than in the reference (`same_sign`) are left out
  of the parameters' distances (the gradients themselves were compared).
  Without this, correct AdamW runs reached 27× their twin's distance (gpt
  pp=2 and dp=4 zero 3, one bias): past NOISE_MULT. The sign is that of the
  first update (runtime/first_step.py, the reference's optimizer stepped once
  from the initial parameters with each run's gradients), not of the gradient:
  Adam's coupled `weight_decay` adds decay·p first, so a gradient of 1.3e-3
  against a decay term of −1.2e-3 flips the step with the gradient's sign kept
  (a probe's classifier under dp=2 × tp=2 zero 3, Adam with amsgrad and weight
  decay 0.01: 2.2× past its bound; 0.088 with the update's sign).
- Cancelled gradients (every precision, `uncancelled`): an element whose step-0
  gradient is a sum of terms that cancelled to below CANCELLED (1e-3) of its
  tensor's RMS gradient carries their rounding, ~1000x coarser relative to
  itself than its neighbours', and an optimizer that normalises each element's
  step (Adam: ~lr whatever |g|) passes that relative error on to the parameter.
  Such an element is left out of the parameters' distances when the parallel
  run's step-0 gradient of it is the reference's to within SAME_SUM (10%): the
  same sum, rounded otherwise (all gradients were compared at step 0 anyway).
  A gradient further off (a flip, a wrong sum) and an exact zero (a token absent
  from the batch) stay compared. Found by a probe: gpt at width 32 under tp=2
  (fc1 col, fc2 row), AdamW, `fc1.bias` element 48 with a step-0 gradient of
  1.26e-7 against a median of 1.8e-3, moved 6.5e-3 relative by the col slice's
  other blocking; its parameter ended 1.3e-7 apart, 2.6x the tensor's bound,
  while the twin and the split left that sum bit for bit. Every parameter is
  then within 0.12 of its bound.
- Losses (`loss_running_max`): each step against the twin's largest relative
  difference so far. The twin's per-step distance swings 60× between steps
  (1.1e-6 to 6.9e-5 on gpt dp=2); against the step's own, correct 10-step
  runs reached 1.64 of the bound (mlp zero 2), 1.35 (gpt zero 3).
- Buffers: floating ones within the twin's bound too, integer ones equal, and
  a tied alias (a state_dict entry equal to a reference parameter) must equal
  its parameter in the parallel run (fp32's allclose failed the tied lm_head).

A model built in bf16 or fp16 and trained as built (`precision fp32`) rounds its
gradients, parameters and optimizer states in that format (`calibration_for`): its
calibration is bf16's, with the floor of both gradients and parameters one ulp of
the built format per element a step (each run rounds each stored element to it;
no fp32 masters take the update's rounding, so not 4), and each step's loss
bound adds one ulp of it (`loss_floor`: the loss is a value of the format; a
probe's tp=2 classifier under Adam was one bf16 ulp, 7.3e-3, apart at step 1
with its tensors at 0.13 of their bounds). A tensor stored in a
coarser dtype than the calibration's gets that floor too (a model mixing bf16
Linears and fp32 norms). Measured on tests/models/mlp_bf16.py (dp=2, SGD) and a
bf16-built HF Llama (dp=2, AdamW): fp32's floor put the MLP's head bias 570× past
its bound (the twin reproduces it bit for bit); now 0.05 (gradients) and 0.02
(parameters), while `skip-grad-sync` and `grad-scale` put step 0's gradients
10.3× and 7.7× (Llama: 5.5× and 4.0×) past theirs. A 4-ulp floor, 12% of a
tensor's norm after 3 steps, would also pass a run that never stepped. The
order-dependence gate cannot read such a model's own loss: it is one bf16 ulp
(7e-3) from another order's. It reads instead a one-step pair with the loss of the
output upcast to fp32 and the batch reversed without the nudge (runtime/check.py
`_measure`): a bf16 Llama's samples come out bit for bit in either order, so the
pair differs by 1e-7, and attention dropout 0.1 moves it by 6e-4.

Measured (bf16, gloo, 2 cores; examples/gpt.py at 4 layers of width 32,
examples/llama.py at 4 layers, examples/mlp.py at 4 layers of width 16; the
specs/ files gpt_dp (dp=4, grad_accum 2), gpt_zero3 (dp=4), gpt_tp, gpt_pp,
gpt_tp_pp, gpt_3d, gpt_recompute (dp×tp, zero 3), llama_tp, llama_tp_dp,
llama_pp_recompute, mlp_dp (zero 2), mlp_tp, mlp_pp_auto, and dp=2 under zero
0, zero 1 and reduce fp32; the models' AdamW and SGD; 3 and 10 steps): every
correct run is at most 0.12 of its bound on gradients, 0.14 on parameters and
0.25 on losses (and so with `grad-ulp`). `skip-grad-sync` puts step 0's
gradients 3.6× (llama dp×tp) to 14.5× past their bound and the parameters
5.3× to 30×; `grad-scale` the gradients 4.5× to 9.6×. NOISE_MULT = 16 stays:
7× over the worst correct run, 3.6× under the mildest bug.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from parc.dsl.ast import Precision

from .equivalence import LOSS_RTOL
from .first_step import StepSigns, gradient_signs
from .probes import GradientProbe, nudge_outputs

__all__ = [
    "CALIBRATIONS",
    "FP32_EPS",
    "NOISE_MULT",
    "TWIN_GATE",
    "Calibration",
    "GradientProbe",
    "TensorBound",
    "calibration_for",
    "floor",
    "nudge_outputs",
    "same_sign",
    "tensor_bounds",
    "uncancelled",
]

NOISE_MULT = 16.0
# Below this share of its tensor's RMS step-0 gradient, a nonzero gradient element is a
# cancelled sum whose rounding the optimizer may amplify; within SAME_SUM of the
# reference's, another run's is that sum rounded otherwise (the module docstring).
CANCELLED = 1e-3
SAME_SUM = 0.1
FP32_EPS = 2.0**-23
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps: 8 significant bits
FLOOR_ULPS = 4.0
# A reordered sum moves an fp32 loss by ~1e-7; dropout or an order-dependent
# model moves it by its own effect (>1e-3 for p=0.1). LOSS_RTOL sits between.
TWIN_GATE = LOSS_RTOL


@dataclass(frozen=True, slots=True)
class Calibration:
    """One precision's bounds (the module docstring has their reasons and measurements)."""

    precision: Precision
    grad_eps: float  # the epsilon of the format the gradients were rounded in
    param_eps: float  # the epsilon of the parameters compared (fp32 masters under bf16)
    noise_mult: float = NOISE_MULT
    # Leave out of the parameters' distances the elements whose step-0 gradient changed
    # sign between the runs (rounding at bf16 flips near-zero gradients; the module
    # docstring).
    excuse_flips: bool = False
    # Bound each step's loss by the twin's largest relative difference so far, not the
    # step's own: at bf16 the twin's per-step distance swings 60x between steps.
    loss_running_max: bool = False
    # Ulps per element per step in the floors: 4 where fp32 masters or values take
    # the rounding of an update (the module docstring), 1 for tensors stored in the
    # format itself (a model built in bf16): each run rounds each element to it.
    floor_ulps: float = FLOOR_ULPS
    # Added to each step's loss bound: one ulp of the format a model built in it computes
    # its loss in (a bf16 loss is a bf16 value: two runs one rounding apart differ by 2⁻⁸
    # to 2⁻⁷ of it, found by a probe at 7.3e-3 under tp=2); 0 for fp32 and the bf16 recipe,
    # whose losses are fp32.
    loss_floor: float = 0.0

    def grad_floor(self) -> float:
        return floor(0, self.grad_eps, self.floor_ulps)

    def param_floor(self, steps: int) -> float:
        return floor(steps, self.param_eps, self.floor_ulps)


CALIBRATIONS = {
    Precision.FP32: Calibration(Precision.FP32, FP32_EPS, FP32_EPS),
    Precision.BF16: Calibration(
        Precision.BF16, BF16_EPS, FP32_EPS, excuse_flips=True, loss_running_max=True
    ),
}


@dataclass(frozen=True, slots=True)
class TensorBound:
    """One tensor's distance from the reference and the bound it must stay under."""

    name: str
    diff: float  # ‖parallel − reference‖
    bound: float  # NOISE_MULT · ‖twin − reference‖ + floor

    @property
    def ratio(self) -> float:
        return self.diff / self.bound if self.bound > 0 else (0.0 if self.diff == 0 else 1e30)


def calibration_for(precision: Precision, ref_params: dict[str, torch.Tensor]) -> Calibration:
    """`precision`'s calibration, or where the model was built in a lower precision (its
    reference parameters bf16 or fp16 under `precision fp32`) that of its built format:
    the gradients and parameters are then rounded in it, so its sign flips and loss
    swings are bf16's (the module docstring). Each tensor's floor takes its own dtype's
    epsilon at least (`tensor_bounds`)."""
    cal = CALIBRATIONS[precision]
    low = [
        torch.finfo(p.dtype).eps
        for p in ref_params.values()
        if p.is_floating_point() and torch.finfo(p.dtype).eps > cal.param_eps
    ]
    if not low:
        return cal
    return dataclasses.replace(
        cal,
        grad_eps=max(cal.grad_eps, *low),
        param_eps=max(low),
        excuse_flips=True,
        loss_running_max=True,
        floor_ulps=1.0,
        loss_floor=max(low),
    )


def floor(steps: int, eps: float = FP32_EPS, ulps: float = FLOOR_ULPS) -> float:
    """The relative floor after `steps` updates of tensors rounded to `eps` (the module
    docstring)."""
    return ulps * eps * (steps + 1)


def tensor_bounds(
    ref: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor],
    par: dict[str, torch.Tensor],
    steps: int,
    eps: float = FP32_EPS,
    noise_mult: float = NOISE_MULT,
    keep: dict[str, torch.Tensor] | None = None,
    ulps: float = FLOOR_ULPS,
) -> list[TensorBound]:
    """Every reference tensor's distance and bound; a tensor missing from `par` gets inf.
    `keep`: per tensor, the elements the distances are measured on (default: all). The
    floor is `ulps` of `eps` a step, or one of the tensor's own dtype's where that is
    coarser (it is stored in it)."""
    out = []
    for name, expected in ref.items():
        got = par.get(name)
        scale = float(expected.norm())
        mask = (keep or {}).get(name)
        noise = float(_masked(twin[name] - expected, mask).norm())
        own = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
        low = floor(steps, own, 1.0) if own > eps else floor(steps, eps, ulps)
        bound = noise_mult * noise + low * scale
        if got is None or got.shape != expected.shape:
            out.append(TensorBound(name, float("inf"), bound))
        else:
            out.append(TensorBound(name, float(_masked(got - expected, mask).norm()), bound))
    return out


def _masked(diff: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return diff if mask is None else diff[mask]


def same_sign(
    ref: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor],
    par: dict[str, torch.Tensor],
    signs: StepSigns = gradient_signs,
) -> dict[str, torch.Tensor]:
    """Per parameter, the elements whose first step goes the same way in all three runs:
    `signs` of each run's step-0 gradients (runtime/first_step.py: the optimizer's first
    update, which coupled weight decay moves off the gradient's sign; default the
    gradients' own signs). A parameter the parallel run lacks, or of another shape, keeps
    every element."""
    shared = {n: g for n, g in par.items() if n in ref and g.shape == ref[n].shape}
    want, other, got = signs(ref), signs({n: twin[n] for n in shared}), signs(shared)
    return {n: (other[n] == want[n]) & (got[n] == want[n]) for n in shared}


def uncancelled(
    ref: dict[str, torch.Tensor], par: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per tensor of the reference's step-0 gradients `ref`, the elements the parameters'
    distances keep: all but the cancelled ones whose parallel gradient (`par`) is the same
    sum rounded otherwise (the module docstring)."""
    out = {}
    for name, g in ref.items():
        other = par.get(name)
        if other is None or other.shape != g.shape:
            continue
        size = g.abs().float()
        rms = float(size.norm()) / max(g.numel(), 1) ** 0.5
        cancelled = (size > 0) & (size < CANCELLED * rms)
        same = (other.float() - g.float()).abs() <= SAME_SUM * size
        out[name] = ~(cancelled & same)
    return out
