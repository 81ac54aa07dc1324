"""One rank of bench/large_model.py's compile-only part: `parc.compile`, then its peak RSS.

Started by torchrun (one process per rank): joins the gloo world, compiles the spec
in argv[1] for the model in argv[2] with `parc.compile` (the deferred build and the
rank's own tensors materialised), and prints one JSON line with its rank, the
seconds it took and its `ru_maxrss` before (parc's and torch's compiler modules
imported, the world joined) and after the compile. No step is run.
Not a benchmark (run_all.py skips files starting with `_`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch.fx.experimental.symbolic_shapes  # noqa: F401  (sympy: imported before measuring)

import parc
import parc.compiler.frontend  # the compiler's modules, imported before measuring
import parc.compiler.rank_program
from parc.compiler.plan import MeshPlan
from parc.dsl.parser import load_spec
from parc.runtime.mesh import init_world


def _main(spec: str, model: str, batch: int) -> None:
    axes = load_spec(spec).mesh.axes
    init_world(MeshPlan(tuple((a.name, a.size) for a in axes)))
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parc.compile(spec, model, batch=batch)
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = int(os.environ["RANK"])
    print(json.dumps({"rank": rank, "seconds": took, "rss_before": before, "ru_maxrss": peak}))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
