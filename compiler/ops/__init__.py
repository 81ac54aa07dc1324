"""Graph-level ops that compiler passes insert as fx nodes, shared with the runtime.

A leaf package: it imports neither `parc.compiler.passes` nor `parc.runtime`,
so compiling a program needs no runtime. The ops reach the running process
group through small registries set at run time:

- `collectives`: `CommKind` and the tensor-parallel conversions (`tp_enter`,
  `tp_all_reduce`, `tp_all_gather`, `tp_slice`, `tp_reduce_scatter`; their
  rows are in compiler/conversions.py); they call the active `Comm`
  (runtime/collectives.py), registered with `comm_activated`.
- `zero3`: `zero3_gather` / `zero3_view`; the gather calls the active ZeRO-3
  runtime (runtime/zero3.py), registered with `zero3_activated`.
- `recompute`: the `Recomputed` module that the recompute pass calls a region
  through.
"""
