"""How long `parc compile` takes on a 48-layer, d_model 1024 GPT with TP + PP (target < 3 s).

    OMP_NUM_THREADS=1 .venv/bin/python bench/compile_time.py            # prints the section
    OMP_NUM_THREADS=1 .venv/bin/python bench/compile_time.py --profile  # cProfile, cold call

The spec is bench/gpt48_tp_pp.par (mesh pp=4 tp=2, Megatron col/row shards,
`stage auto`, 8 microbatches); the model is examples/gpt.py sized by GPT_ENV.
Every measurement runs in fresh processes, RUNS times; the median is reported:

1. The front end in-process: `analyse(spec, model)` + `format_report`, with
   parc's imports excluded. The first call in a process is "cold": it still
   pays torch's lazy imports (torch._dynamo, first pulled in by `nn.init` on
   the meta device). A second call in the same process is "warm". Phases of
   the cold call are timed by wrapping the functions `analyse` calls (so they
   follow its code); full (generation 2) garbage collections are timed too.
2. The whole CLI process, `.venv/bin/parc compile SPEC examples/gpt.py`:
   interpreter start, imports, front end, report and pipeline grid, exit.
   The same `parc.cli.main` timed inside a process splits off the start and
   exit of the interpreter (tearing down what the front end left behind).
3. The import floor: a process that only imports what the CLI imports.
4. The torch.export capture (bench/_capture_time.py): the same GPT with torch.fx
   refused, a Hugging Face LlamaForCausalLM of its size through the front end,
   and `parc plan` of LLaMA 3 70B's config (target < 30 s), each cold.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _capture_time as capture_time
from _common import PYTHON, ROOT, VENV_BIN, md_table, median

SPEC = ROOT / "bench" / "gpt48_tp_pp.par"
MODEL = ROOT / "examples" / "gpt.py"
GPT_ENV = {
    "GPT_LAYERS": "48",
    "GPT_DIM": "1024",
    "GPT_HEADS": "16",
    "GPT_VOCAB": "50304",  # GPT-2's vocabulary padded to a multiple of 64, as nanoGPT does
    "GPT_SEQ": "1024",
}
RUNS = 3
TARGET_S = 3.0  # the target for `parc compile` of this model
_CHILD_TIMEOUT_S = 120.0

# What `analyse` calls, in order, with what each does (names in parc.compiler.frontend).
_PHASES = {
    "load_model": "import the model file",
    "build_model": "build_model() on the meta device (init included)",
    "sample_batch": "sample_batch() at the micro-batch size",
    "check_batch": "batch arithmetic checks",
    "trace_model": "torch.fx symbolic trace",
    "propagate_shapes": "ShapeProp on fake tensors (a fake copy of the model first)",
    "resolve": "spec + graph -> Plan (stage auto included)",
    "saved_tensors": "fake forward recording saved activations",
    "estimate": "memory / communication / bubble estimate",
    "format_report": "report text",
}

__all__ = ["main"]


# --------------------------------------------------------------------------- child


def _timed(fn: Callable[..., Any], name: str, times: dict[str, float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def _instrument(times: dict[str, float]) -> None:
    from parc.compiler import frontend
    from parc.compiler.model import ModelSource

    for name in _PHASES:
        if callable(getattr(frontend, name, None)):
            setattr(frontend, name, _timed(getattr(frontend, name), name, times))
    ModelSource.build = _timed(ModelSource.build, "build_model", times)  # type: ignore[method-assign]
    ModelSource.batch = _timed(ModelSource.batch, "sample_batch", times)  # type: ignore[method-assign]


def _time_full_gc(times: dict[str, float]) -> None:
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2 and phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            times["full GC"] = times.get("full GC", 0.0) + time.perf_counter() - started[0]
            times["full GCs"] = times.get("full GCs", 0) + 1

    gc.callbacks.append(on_gc)


def _child() -> None:
    """One fresh process: import, then a cold and a warm front end; JSON on stdout."""
    start = time.perf_counter()
    from parc.compiler.frontend import analyse
    from parc.compiler.report import format_report

    imports = time.perf_counter() - start
    phases: dict[str, float] = {}
    _instrument(phases)
    collections: dict[str, float] = {}
    _time_full_gc(collections)
    calls = []
    for _ in range(2):
        phases.clear()
        collections.clear()
        start, cpu = time.perf_counter(), time.process_time()
        a = analyse(str(SPEC), str(MODEL))
        report_start = time.perf_counter()
        format_report(a.plan, a.estimate, title="bench")
        end = time.perf_counter()
        phases["format_report"] = end - report_start
        calls.append(
            {
                "wall": end - start,
                "cpu": time.process_time() - cpu,
                "phases": dict(phases),
                "gc": dict(collections),
            }
        )
    print(json.dumps({"imports": imports, "cold": calls[0], "warm": calls[1]}))


def _cli_child() -> None:
    """`parc.cli.main` timed from inside its process (report discarded); JSON on stdout."""
    import contextlib
    import io

    start = time.perf_counter()
    from parc.cli import main as cli

    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["compile", str(SPEC), str(MODEL)])
    print(json.dumps({"main": time.perf_counter() - start, "code": code}))


# --------------------------------------------------------------------------- parent


def _run(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU (user + sys) seconds of a child process, and its stdout."""
    env = {**os.environ, **GPT_ENV, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, done.stdout


def _verdict(seconds: float) -> str:
    return "met" if seconds < TARGET_S else f"missed ({seconds / TARGET_S:.2f}×)"


def _row(what: str, wall: list[float], cpu: list[float] | None, includes: str) -> list[str]:
    return [
        what,
        f"{median(wall):.2f} s",
        f"{min(wall):.2f}–{max(wall):.2f} s",
        f"{median(cpu):.2f} s" if cpu else "–",
        f"< {TARGET_S:.0f} s: {_verdict(median(wall))}" if cpu else "–",
        includes,
    ]


def _measure() -> dict[str, Any]:
    runs: dict[str, Any] = {"child": [], "cli": [], "floor": [], "inside": []}
    for i in range(RUNS):
        print(f"compile_time: run {i + 1}/{RUNS}", file=sys.stderr, flush=True)
        out = _run([str(PYTHON), __file__, "--child"])[2]
        runs["child"].append(json.loads(out.strip().splitlines()[-1]))
        runs["cli"].append(_run([str(VENV_BIN / "parc"), "compile", str(SPEC), str(MODEL)])[:2])
        runs["floor"].append(_run([str(PYTHON), "-c", _FLOOR])[:2])
        wall, _, out = _run([str(PYTHON), __file__, "--cli-child"])
        inside = json.loads(out.strip().splitlines()[-1])["main"]
        runs["inside"].append((inside, wall - inside))
    return runs


_FLOOR = "import parc.cli, parc.compiler.frontend, parc.compiler.report"


def _summary_table(runs: dict[str, Any]) -> str:
    child, cli, floor = runs["child"], runs["cli"], runs["floor"]
    rows = [
        _row(
            "front end, cold",
            [c["cold"]["wall"] for c in child],
            [c["cold"]["cpu"] for c in child],
            "first `analyse` + `format_report` in a fresh process; parc's imports "
            "excluded, torch's lazy imports made inside the call included",
        ),
        _row(
            "front end, warm",
            [c["warm"]["wall"] for c in child],
            [c["warm"]["cpu"] for c in child],
            "a second call in the same process",
        ),
        _row(
            "`parc compile` process",
            [w for w, _ in cli],
            [c for _, c in cli],
            "the whole CLI: interpreter, imports, front end, report, pipeline grid",
        ),
        _row(
            "of which: `parc.cli.main`",
            [m for m, _ in runs["inside"]],
            None,
            "imports (torch included), front end, report: timed inside the process",
        ),
        _row(
            "of which: interpreter start + exit",
            [e for _, e in runs["inside"]],
            None,
            "the rest of that process's wall time, mostly tearing down at exit",
        ),
        _row("import floor", [w for w, _ in floor], None, f"`python -c '{_FLOOR}'`"),
    ]
    header = ["measurement", "wall (median)", "wall (range)", "CPU (median)", "target", "includes"]
    return md_table(header, rows)


def _phase_table(runs: dict[str, Any]) -> str:
    child = runs["child"]
    rows = []
    for name, what in _PHASES.items():
        cold = [c["cold"]["phases"].get(name, 0.0) for c in child]
        warm = [c["warm"]["phases"].get(name, 0.0) for c in child]
        if any(cold):
            rows.append([f"`{name}`", f"{median(cold):.2f} s", f"{median(warm):.2f} s", what])
    rest = [c["cold"]["wall"] - sum(c["cold"]["phases"].values()) for c in child]
    rows.append(["rest of `analyse`", f"{median(rest):.2f} s", "–", "glue between the phases"])
    cold_gc = [c["cold"]["gc"].get("full GC", 0.0) for c in child]
    warm_gc = [c["warm"]["gc"].get("full GC", 0.0) for c in child]
    count = median(c["cold"]["gc"].get("full GCs", 0) for c in child)
    rows.append(
        [
            "of which: full GCs",
            f"{median(cold_gc):.2f} s",
            f"{median(warm_gc):.2f} s",
            f"{count:.0f} generation-2 garbage collections (cold), inside the phases above",
        ]
    )
    return md_table(["phase", "cold", "warm", "what"], rows)


def main() -> str:
    """Run the measurements; return the markdown section for bench/RESULTS.md."""
    runs = _measure()
    captures = capture_time.measure(RUNS)
    size = " ".join(f"{k}={v}" for k, v in GPT_ENV.items())
    return "\n\n".join(
        [
            "## Compile time: `parc compile` of a 48-layer GPT (TP + PP)",
            f"Model `examples/gpt.py` with `{size}`; spec `bench/gpt48_tp_pp.par` "
            "(`mesh pp=4 tp=2`, col/row shards of qkv/proj/fc1/fc2, `stage auto`, "
            f"8 microbatches), default global batch 8. {RUNS} fresh processes per row. "
            "The target is on wall time; CPU time (user + sys) is what wall time would be "
            "on an idle core, since the front end is single-threaded.",
            _summary_table(runs),
            "Where the cold front end spends its time (wall, median; phases are the "
            "functions `analyse` calls):",
            _phase_table(runs),
            f"Reproduce: `{size} time .venv/bin/parc compile bench/gpt48_tp_pp.par "
            "examples/gpt.py`; `python bench/compile_time.py --profile` prints a cProfile "
            "of the cold call.",
            "### The torch.export capture",
            "A model torch.fx cannot trace (every Hugging Face model) is captured with "
            "`torch.export` (non-strict, on a meta twin) and raised to the torch-level graph "
            "(compiler/capture.py). The rows: the same 48-layer GPT and spec with torch.fx "
            "refused, so that its front end goes through the export capture; a Hugging Face "
            "`LlamaForCausalLM` of its size (`bench/_hf_llama48.py`: 48 layers, hidden 1024, "
            "16 heads, intermediate 2816, the GPT's vocabulary and sequence) with "
            "`bench/hf_llama48_tp_pp.par` (the GPT's spec in the HF module names); and "
            "`parc plan examples/hf_llama70b.py --cluster 'nodes=8 preset=h100' --precision "
            f"bf16` (LLaMA 3 70B's config, 80 layers, on meta). {RUNS} fresh processes per "
            "row, cold; the front-end rows time `analyse` + `format_report` as above, the plan "
            "row the whole process. Export costs more than symbolic_trace: it runs every aten "
            "op through FakeTensor and proxy dispatch (a shape for every node), records a "
            "stack trace per node and runs its own passes over the graph, where symbolic_trace "
            "records the Python calls only; the example models still trace with torch.fx "
            "(export is the fallback), so their front end is the table above.",
            capture_time.section(captures),
            "Reproduce: `OMP_NUM_THREADS=1 CAPTURE_RUNS=1 .venv/bin/python "
            "bench/_capture_time.py` prints these tables alone.",
        ]
    )


def _profile() -> None:
    import cProfile
    import pstats

    os.environ.update(GPT_ENV)
    from parc.compiler.frontend import analyse
    from parc.compiler.report import format_report

    profiler = cProfile.Profile()
    profiler.enable()
    a = analyse(str(SPEC), str(MODEL))
    format_report(a.plan, a.estimate, title="bench")
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child()
    elif "--cli-child" in sys.argv:
        _cli_child()
    elif "--profile" in sys.argv:
        _profile()
    else:
        print(main())
