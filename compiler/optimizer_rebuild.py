"""An optimizer like the user's over other parameters: ZeRO's shards, the probe's tensors.

ZeRO gives each dp rank's optimizer a flat shard instead of the model's parameters
(runtime/assemble.py), so parc builds a second instance of the user's optimizer
class. What configures an instance lives in two places: its parameter groups
(`lr`, `betas`, ... as torch's optimizers keep them) and, for a hand-written class,
possibly its own attributes (`self.scale = scale`). `rebuilt_like` constructs the
class over the new groups, passing each constructor keyword the instance was made with
(its `defaults`, a required `lr` included), then compares the plain attributes (numbers, strings,
flags) of both instances: one the rebuild cannot restore is a ParcError naming
it, never a silently different optimizer.

    >>> class Scaled(torch.optim.SGD):
    ...     def __init__(self, params, lr=0.1, scale=1.0):
    ...         super().__init__(params, lr=lr)
    ...         self.scale = scale
    >>> lost_settings(Scaled([torch.nn.Parameter(torch.zeros(2))], scale=0.01))
    ['scale=0.01 (rebuilt: 1.0)']
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from parc.errors import ParcError

__all__ = ["construct_like", "lost_settings", "rebuilt_like"]

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _base_attributes() -> frozenset[str]:
    """What `torch.optim.Optimizer.__init__` sets on every instance (hooks, state, groups)."""
    base = torch.optim.Optimizer([torch.nn.Parameter(torch.zeros(1))], {})
    return frozenset(vars(base))


_BASE = _base_attributes()


def construct_like(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> Any:
    """`type(opt)` over `groups`, given each constructor keyword `opt` was made with: its
    `defaults` (what the constructor stored), else what its first group holds. Not the
    first group first: a keyword the constructor reads itself (Adagrad's
    `initial_accumulator_value` fills every state with the constructor's value, whatever a
    group says) must be the user's, or a rebuild over ZeRO shards starts from other state
    than one device (found by a probe: a first group's own value trained otherwise)."""
    cls: Any = type(opt)
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    hyper.update(getattr(opt, "defaults", None) or {})
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return cls(groups)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keywords = [n for n, p in signature.parameters.items() if p.kind in named][2:]  # self, params
    return cls(groups, **{n: hyper[n] for n in keywords if n in hyper})


def _plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _differences(opt: torch.optim.Optimizer, new: torch.optim.Optimizer) -> list[str]:
    """The plain attributes of `opt` (not the base class's) that `new` lacks or differs in."""
    out = []
    for key, value in vars(opt).items():
        if key in _BASE or not _plain(value):  # tensors, params, callables: not settings
            continue
        other = vars(new).get(key, _MISSING)
        if other is _MISSING or type(other) is not type(value) or other != value:
            got = "missing" if other is _MISSING else repr(other)
            out.append(f"{key}={value!r} (rebuilt: {got})")
    return out


def lost_settings(opt: torch.optim.Optimizer) -> list[str]:
    """What a rebuild of `opt` (over one small parameter) would not restore; [] when
    nothing, or when the class cannot be rebuilt at all (the probe says so)."""
    try:
        new = construct_like(opt, [{"params": [torch.nn.Parameter(torch.zeros(2))], **_hyper(opt)}])
    except Exception:  # the class's own refusal: locality_of reports it as unknown
        return []
    return _differences(opt, new)


def _hyper(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def rebuilt_like(opt: torch.optim.Optimizer, params: list[list[torch.nn.Parameter]]) -> Any:
    """`type(opt)` over `params[g]` in group g with the settings of `opt`'s group g (one
    list per group of `opt`), and `opt`'s own attributes; a ParcError when an attribute
    cannot be restored."""
    groups = [
        {"params": ps, **{k: v for k, v in group.items() if k != "params"}}
        for ps, group in zip(params, opt.param_groups, strict=True)
    ]
    new = construct_like(opt, groups)
    lost = _differences(opt, new)
    if lost:
        raise ParcError(
            f"{type(opt).__name__} keeps settings outside its parameter groups that parc "
            f"cannot restore when it builds the optimizer again over other tensors: "
            f"{', '.join(lost)}",
            hint="pass them through the parameter groups (e.g. super().__init__(params, "
            "dict(lr=lr, scale=scale)) and read group['scale'] in step), or use zero 0",
        )
    return new
