"""The torch.export capture's rows of bench/compile_time.py (a helper, not a benchmark).

Four cases, each timed cold in RUNS fresh processes (`python bench/_capture_time.py
--child CASE` prints one JSON line):

- `gpt-fx`: the front end (`analyse` + `format_report`) of the 48-layer example
  GPT with bench/gpt48_tp_pp.par, traced by torch.fx as it always is;
- `gpt-export`: the same, with torch.fx refused (`trace._symbolic` raises the
  CompileError a model fx cannot trace raises), so `trace_model` falls back to
  the torch.export capture and the rest of the front end reads its graph;
- `hf48`: the front end of a Hugging Face LlamaForCausalLM the GPT's size
  (bench/_hf_llama48.py, bench/hf_llama48_tp_pp.par), which only export captures;
- `plan70b`: `parc plan` of examples/hf_llama70b.py (LLaMA 3 70B's config,
  80 layers, on meta) for 8 nodes of 8 H100s in bf16, the whole process.

Phases are timed by wrapping the functions the front end and the planner call,
wall and CPU; "raise" is `capture_model` less `export_model`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import PYTHON, ROOT, md_table, median

__all__ = ["CASES", "measure", "section"]


@dataclass(frozen=True, slots=True)
class Case:
    what: str  # the row's name
    spec: str  # a spec for the front end; "" for `parc plan`
    model: str
    target_s: float
    capture: str  # which capture it goes through, in words


GPT_ENV = {"GPT_LAYERS": "48", "GPT_DIM": "1024", "GPT_HEADS": "16", "GPT_VOCAB": "50304"}
GPT_ENV["GPT_SEQ"] = "1024"
PLAN_CLUSTER = "nodes=8 preset=h100"
CASES = {
    "gpt-fx": Case(
        "48-layer GPT, front end", "bench/gpt48_tp_pp.par", "examples/gpt.py", 3.0, "torch.fx"
    ),
    "gpt-export": Case(
        "48-layer GPT, front end",
        "bench/gpt48_tp_pp.par",
        "examples/gpt.py",
        3.0,
        "torch.export (fx refused)",
    ),
    "hf48": Case(
        "HF LlamaForCausalLM, 48 layers × 1024, front end",
        "bench/hf_llama48_tp_pp.par",
        "bench/_hf_llama48.py",
        3.0,
        "torch.export",
    ),
    "plan70b": Case(
        "`parc plan` HF LlamaForCausalLM 70B (80 layers), whole process",
        "",
        "examples/hf_llama70b.py",
        30.0,
        "torch.export",
    ),
}
_TIMEOUT_S = 300.0

# phase -> (what it is, the (module, attribute) names it wraps)
_PHASES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "build": ("build_model() on meta (HF: importing its model code)", (("model", "build"),)),
    "fx trace": ("torch.fx symbolic_trace", (("trace", "_symbolic"),)),
    "export": ("torch.export.export, non-strict, of a meta twin", (("capture", "export_model"),)),
    "capture": ("", (("capture", "capture_model"),)),  # shown as "raise": capture - export
    "fake forward": (
        "shapes and saved tensors (FakeTensorMode)",
        (("frontend", "profile_forward"), ("planner.model_profile", "profile_forward")),
    ),
    "resolve": (
        "spec + graph -> Plan (per tp size in the planner)",
        (("frontend", "resolve"), ("planner.model_profile", "resolve")),
    ),
    "TP analysis": (
        "tensor-parallel placements (per tp size in the planner)",
        (
            ("passes.tp_analysis", "analyse_tensor_parallel"),
            ("planner.model_profile", "analyse_tensor_parallel"),
        ),
    ),
    "estimate / search": (
        "the estimate (front end); every candidate spec costed (planner)",
        (("frontend", "estimate"), ("planner.advise", "search")),
    ),
}


def _timed(fn: Callable[..., Any], name: str, times: dict[str, list[float]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = times.setdefault(name, [0.0, 0.0])
            spent[0] += time.perf_counter() - start
            spent[1] += time.process_time() - cpu

    return wrapper


def _instrument(times: dict[str, list[float]]) -> None:
    for phase, (_, targets) in _PHASES.items():
        for module_name, attr in targets:
            module = importlib.import_module(f"parc.compiler.{module_name}")
            owner = module.ModelSource if attr == "build" else module
            setattr(owner, attr, _timed(getattr(owner, attr), phase, times))


def _refuse_fx() -> None:
    from parc.compiler import trace
    from parc.errors import CompileError

    def refuse(model: Any, inputs: Any = None) -> Any:
        raise CompileError("bench/_capture_time.py: torch.fx refused, to time torch.export")

    trace._symbolic = refuse  # type: ignore[assignment]


def _child(name: str) -> None:
    """One fresh process: the case, cold; JSON on stdout."""
    case = CASES[name]
    from parc.cli import main as cli
    from parc.compiler.frontend import analyse
    from parc.compiler.report import format_report

    times: dict[str, list[float]] = {}
    _instrument(times)
    if name == "gpt-export":
        _refuse_fx()
    start, cpu = time.perf_counter(), time.process_time()
    if case.spec:
        a = analyse(case.spec, case.model)
        format_report(a.plan, a.estimate, title="bench")
        capture = a.gm.meta.get("parc_capture", "fx")
    else:
        args = ["plan", case.model, "--cluster", PLAN_CLUSTER, "--precision", "bf16"]
        with contextlib.redirect_stdout(io.StringIO()):
            if cli(args) != 0:
                raise RuntimeError(f"parc {' '.join(args)} found no spec")
        capture = "export"
    out = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    print(json.dumps({**out, "phases": times, "capture": capture}))


def measure(runs: int) -> dict[str, list[dict[str, Any]]]:
    """Every case in `runs` fresh processes; each result has the process's wall time too."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    env = {**os.environ, **GPT_ENV, "OMP_NUM_THREADS": "1"}
    for i in range(runs):
        for name in CASES:
            print(f"compile_time: {name} {i + 1}/{runs}", file=sys.stderr, flush=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            done = subprocess.run(
                [str(PYTHON), __file__, "--child", name],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append({**result, "process": wall, "process_cpu": cpu})
    return results


def _cell(values: list[float]) -> str:
    return f"{median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def _phase(results: list[dict[str, Any]], phase: str, cpu: bool = False) -> float:
    col = 1 if cpu else 0
    if phase == "raise":
        return median(
            r["phases"].get("capture", [0, 0])[col] - r["phases"].get("export", [0, 0])[col]
            for r in results
        )
    return median(r["phases"].get(phase, [0, 0])[col] for r in results)


def section(results: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown tables of the capture rows."""
    rows = []
    for name, case in CASES.items():
        rs = results[name]
        whole = not case.spec  # `parc plan`: the whole process, as a user waits for it
        measured = [r["process"] if whole else r["wall"] for r in rs]
        verdict = "met" if median(measured) < case.target_s else "missed"
        cpu = median(r["process_cpu"] if whole else r["cpu"] for r in rs)
        rows.append(
            [
                case.what,
                case.capture,
                _cell(measured),
                f"{cpu:.2f} s",
                f"< {case.target_s:.0f} s: {verdict}",
            ]
        )
    header = ["row", "capture", "wall, cold: median (range)", "CPU (median)", "target"]
    phases = ["build", "fx trace", "export", "raise", *list(_PHASES)[4:]]
    timing = []
    for phase in phases:
        cells = [f"{_phase(results[n], phase, cpu=True):.2f} s" for n in CASES]
        what = "aten graph -> torch-level graph (compiler/capture.py)" if phase == "raise" else ""
        timing.append([f"`{phase}`", *cells, what or _PHASES[phase][0]])
    rest = [
        # `capture` holds `export` and the raise
        median(r["cpu"] - sum(v[1] for k, v in r["phases"].items() if k != "export") for r in rs)
        for rs in results.values()
    ]
    timing.append(["rest", *[f"{x:.2f} s" for x in rest], "glue, report, the planner's profile"])
    outside = [median(r["process_cpu"] - r["cpu"] for r in rs) for rs in results.values()]
    timing.append(
        [
            "outside the call",
            *[f"{x:.2f} s" for x in outside],
            "the process's imports, interpreter start and exit (in `parc plan`'s row)",
        ]
    )
    return "\n\n".join(
        [
            md_table(header, rows),
            "Where each row's CPU time goes (median; CPU rather than wall, which the "
            "machine's other work inflates):",
            md_table(["phase", *CASES, "what"], timing),
        ]
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(sys.argv[sys.argv.index("--child") + 1])
    else:
        print(section(measure(int(os.environ.get("CAPTURE_RUNS", "1")))))
