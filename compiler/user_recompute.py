"""The modules forward checkpoints itself, as `recompute` regions (compiler/resolve.py).

`compiler/user_checkpoint.py` records the `torch.utils.checkpoint` calls while
the model is traced (`gm.meta["parc_checkpointed"]`); here they become regions:
a module whose call the graph holds, with a note; anything else (a function, a
module's `forward` called directly) a warning.
"""

from __future__ import annotations

import torch
import torch.fx

from .plan import PlanWarning

__all__ = ["checkpointed_modules"]


def checkpointed_modules(
    gm: torch.fx.GraphModule, modules: dict[str, torch.nn.Module], warnings: list[PlanWarning]
) -> list[str]:
    """The modules forward checkpoints itself, with a note; a warning for each call of
    checkpoint on something that is not a module call of the model (a function, or a
    module's `forward` called directly, which the graph holds no call of)."""
    from .passes.recompute import recompute_regions

    seen = gm.meta.get("parc_checkpointed")
    if seen is None:
        return []
    called = set(recompute_regions(gm, tuple(n for n in seen.modules if n in modules)).values())
    names = [n for n in seen.modules if n in called]
    others = [*seen.others, *(seen.modules[n] for n in seen.modules if n not in called)]
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        warnings.append(
            PlanWarning(
                f"forward checkpoints {len(names)} module(s) with torch.utils.checkpoint "
                f"({shown}; at {seen.modules[names[0]]}): parc recomputes them in backward "
                "as a `recompute` line would"
            )
        )
    for site in dict.fromkeys(others):
        warnings.append(
            PlanWarning(
                f"forward calls torch.utils.checkpoint on something that is not a module "
                f"call (a function, or a module's forward called directly), at {site}: parc "
                "traces through it and keeps its activations; checkpoint the module itself, "
                "or name it in a `recompute` line, to recompute it"
            )
        )
    return names
