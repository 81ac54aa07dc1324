"""Models larger than one rank's share of the host (issue 14's Must-show), measured.

    OMP_NUM_THREADS=1 .venv/bin/python bench/large_model.py          # both; writes RESULTS_large.md
    OMP_NUM_THREADS=1 .venv/bin/python bench/large_model.py analyse  # the 20B part only, printed
    OMP_NUM_THREADS=1 .venv/bin/python bench/large_model.py run      # the 1B part only, printed

Not part of `make bench`: it defines no top-level `main()`, which is what run_all.py
looks for, because the second part takes minutes and most of this machine's memory.
It writes its own bench/RESULTS_large.md (RESULTS.md is rewritten by `make bench`).

1. **20B, analysis only.** examples/llama.py's decoder at ~20G parameters (LLAMA_*
   sizes below) under `mesh dp=8` + `zero 3`, in a fresh process:
   `parc.compiler.frontend.analyse` on `meta` (trace, fake forward, plan, estimate),
   then `compile_rank` for rank 0 on the same meta model; wall time of each, and the
   process's peak RSS (`ru_maxrss`). The estimate's device and host bytes per rank
   are printed beside it.
2. **1B, compile and one step.** The same decoder at ~1G parameters
   (bench/_large_llama.py: SGD, so no optimizer state) under `mesh dp=8` + `zero 3`
   on 8 gloo ranks: first `parc.compile` alone (bench/_compile_only.py under
   torchrun; each rank reports its `ru_maxrss` before and after), then one step of
   `parc run`. Each rank's peak RSS is read from /proc (VmHWM, the
   counter `ru_maxrss` reports) every 0.2 s while it runs; a guard stops the run
   (its own process group) if the machine's available memory falls under
   `GUARD_BYTES`. A full-model build on every rank (what `parc.compile` did before
   issue 14) would need 8 × the fp32 model, which is stated, not run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import BENCH, PYTHON, ROOT, VENV_BIN, machine, md_table

RESULTS = BENCH / "RESULTS_large.md"
SPEC = "mesh dp=8\nzero 3\n"
WORLD = 8
SIZES_20B = {  # 19.9G parameters: 50 blocks of 390M, embeddings 2 × 197M
    "LLAMA_LAYERS": "50",
    "LLAMA_DIM": "6144",
    "LLAMA_HEADS": "48",
    "LLAMA_KV_HEADS": "8",
    "LLAMA_FFN": "16384",
    "LLAMA_VOCAB": "32000",
    "LLAMA_SEQ": "2048",
}
# 1.03G parameters: 22 blocks of 45M, embeddings 2 × 16M. A small vocabulary keeps the
# largest ZeRO-3 unit a block (180 MB): a gathered unit, its gradient and gloo's copy of
# it are alive at once on each of the 8 ranks. Short sequences keep the step short.
SIZES_1B = {
    "LLAMA_LAYERS": "22",
    "LLAMA_DIM": "2048",
    "LLAMA_HEADS": "16",
    "LLAMA_KV_HEADS": "4",
    "LLAMA_FFN": "5632",
    "LLAMA_VOCAB": "8000",
    "LLAMA_SEQ": "64",
}
BATCH_1B = 8  # one sample per rank
# glibc keeps freed heap blocks resident (runtime/materialise.py trims after each value;
# the step's gathered units and gradients are freed as fast): tensors over 1 MiB get
# their own mapping, returned to the system when freed, so RSS follows what is alive.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
GUARD_BYTES = 2**30  # stop the run when the machine has less available than this
RUN_LIMIT_S = 1800.0
GIB = 2**30


def _spec_text() -> str:
    return "; ".join(SPEC.strip().splitlines())


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# -- part 1: the 20B analysis, in a fresh process -------------------------------------------


def _analyse_child() -> dict[str, Any]:
    """Runs in the child: analyse on meta, compile rank 0, peak RSS."""
    import resource

    from parc.compiler.frontend import analyse
    from parc.compiler.layout import DEFAULT_BUCKET_ELEMS
    from parc.compiler.rank_program import compile_rank
    from parc.dsl import parse_spec

    started = time.perf_counter()
    analysis = analyse(parse_spec(SPEC), str(ROOT / "examples" / "llama.py"), device="meta")
    analysed = time.perf_counter()
    facts: dict[str, Any] = {"analyse_s": analysed - started}
    facts["params"] = sum(p.numel() for p in analysis.model.parameters())
    facts["nodes"] = len(analysis.gm.graph.nodes)
    facts["rss_after_analyse"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        program = compile_rank(analysis, {"dp": 0}, bucket_elems=DEFAULT_BUCKET_ELEMS)
        facts["compile_rank_s"] = time.perf_counter() - analysed
        facts["rank0_stages"] = len(program.stages)
    except Exception as exc:  # measured, not hidden: the section says what failed
        facts["compile_rank_error"] = f"{type(exc).__name__}: {exc}"[:300]
    facts["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device = analysis.estimate.memory[0]
    facts["device_peak"] = device.peak
    host = analysis.estimate.host[0]
    facts["host"] = {k: getattr(host, k) for k in ("params", "buffers", "largest", "recording")}
    facts["host"]["total"] = host.total
    return facts


def _record_child() -> dict[str, Any]:
    """Runs in the child: what `parc.compile` does first on every rank, the deferred build
    (record every init op on meta; each random op drawn once on a CPU scratch tensor)."""
    import resource

    from parc.compiler.frontend import analyse
    from parc.dsl import parse_spec

    started = time.perf_counter()
    analysis = analyse(parse_spec(SPEC), str(ROOT / "examples" / "llama.py"), deferred=True)
    assert analysis.deferred is not None
    return {
        "record_s": time.perf_counter() - started,
        "record_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _child(function: str, sizes: Mapping[str, str]) -> dict[str, Any]:
    """`large_model.<function>()` in a fresh process (so `ru_maxrss` is its own)."""
    env = {**os.environ, **sizes, "OMP_NUM_THREADS": "1"}
    code = "import sys, json; sys.path.insert(0, sys.argv[1]); import large_model as m; "
    code += f"print(json.dumps(m.{function}()))"
    started = time.perf_counter()
    out = subprocess.run(
        [str(PYTHON), "-c", code, str(BENCH)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"{function} failed:\n{out.stderr[-3000:]}")
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    facts["process_s"] = time.perf_counter() - started
    return facts


def analyse_20b() -> dict[str, Any]:
    """Part 1: the analysis and rank 0's program, then the deferred build, each alone."""
    facts = _child("_analyse_child", SIZES_20B)
    recorded = _child("_record_child", SIZES_20B)
    return {**facts, "record_s": recorded["record_s"], "record_rss": recorded["record_rss"]}


def section_20b(f: Mapping[str, Any]) -> str:
    rank = (
        f"{f['compile_rank_s']:.1f} s"
        if "compile_rank_s" in f
        else f"failed: {f.get('compile_rank_error')}"
    )
    rows = [
        ["parameters", f"{f['params'] / 1e9:.2f}G ({gib(f['params'] * 4)} in fp32)"],
        ["traced nodes", str(f["nodes"])],
        ["`analyse` on meta (trace, fake forward, plan, estimate)", f"{f['analyse_s']:.1f} s"],
        ["`compile_rank` of rank 0 on meta", rank],
        ["whole process (interpreter, imports, both)", f"{f['process_s']:.1f} s"],
        ["peak RSS after `analyse` (`ru_maxrss`)", gib(f["rss_after_analyse"])],
        ["peak RSS of the process (`ru_maxrss`)", gib(f["ru_maxrss"])],
        [
            "`analyse(deferred=True)`: the build recorded, each random op drawn once on a "
            "CPU scratch (what every rank of `parc.compile` does first)",
            f"{f['record_s']:.1f} s",
        ],
        ["peak RSS of that process (`ru_maxrss`)", gib(f["record_rss"])],
        ["estimate: device peak per rank", gib(f["device_peak"])],
        ["estimate: host per rank while compiling", gib(f["host"]["total"])],
        ["  of which parameter shards", gib(f["host"]["params"])],
        ["  of which buffers (rotary tables, causal masks)", gib(f["host"]["buffers"])],
        ["  of which the largest full parameter", gib(f["host"]["largest"])],
        ["  of which recording and graphs", gib(f["host"]["recording"])],
    ]
    sizes = " ".join(f"{k}={v}" for k, v in SIZES_20B.items())
    return "\n".join(
        [
            "## 20B LLaMA-shaped, `mesh dp=8` + `zero 3`: `parc compile` analysis on meta",
            "",
            f"Model `examples/llama.py` with `{sizes}`; spec `{_spec_text()}` (world 8).",
            "",
            md_table(["measurement", "value"], rows),
        ]
    )


# -- part 2: the 1B run on 8 gloo ranks -----------------------------------------------------


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _rank_peaks(root: int) -> dict[int, int]:
    """Rank -> VmHWM bytes of every descendant of `root` that has a RANK variable."""
    kids, found, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        hwm = next((ln for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
        if rank is not None and hwm is not None and pid != root:
            found[int(rank)] = int(hwm.split()[1]) * 1024
    return found


def _guarded_wait(
    proc: subprocess.Popen[str], started: float, poll: Callable[[float], None] | None = None
) -> int | None:
    """Wait for `proc`, calling `poll(seconds since started)` every 0.2 s; stop its process
    group when free memory falls under GUARD_BYTES (returns the free bytes then) or after
    RUN_LIMIT_S."""
    low = None
    while proc.poll() is None:
        if poll is not None:
            poll(time.perf_counter() - started)
        if _available() < GUARD_BYTES and low is None:
            low = _available()
            os.killpg(proc.pid, signal.SIGTERM)  # our own run's process group only
        if time.perf_counter() - started > RUN_LIMIT_S:
            os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
    return low


def run_1b() -> dict[str, Any]:
    """Part 2: `parc run` of one step; per-rank peak RSS, polled."""
    env = {**os.environ, **SIZES_1B, "OMP_NUM_THREADS": "1", **MALLOC}
    model = str(BENCH / "_large_llama.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec, log = Path(tmp) / "dp8_zero3.par", Path(tmp) / "loss.jsonl"
        spec.write_text(SPEC)
        argv = [str(VENV_BIN / "parc"), "run", str(spec), model, "--steps", "1"]
        argv += ["--batch", str(BATCH_1B), "--log", str(log)]
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        peaks: dict[int, int] = {}
        peak_at: dict[int, float] = {}  # seconds from the start when the peak was reached
        stepped = None  # when the loss line appeared: the step had ended

        def poll(now: float) -> None:
            nonlocal stepped
            for rank, hwm in _rank_peaks(proc.pid).items():
                if hwm > peaks.get(rank, 0):
                    peaks[rank], peak_at[rank] = hwm, now
            if stepped is None and log.exists() and log.read_text().strip():
                stepped = now

        low = _guarded_wait(proc, started, poll)
        output = proc.stdout.read() if proc.stdout else ""
        took = time.perf_counter() - started
        losses = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "code": proc.returncode,
        "seconds": took,
        "peaks": {str(r): peaks[r] for r in sorted(peaks)},
        "peak_at": {str(r): peak_at[r] for r in sorted(peak_at)},
        "stepped_at": stepped,
        "stopped_low_memory": low,
        "losses": losses,
        "output_tail": output[-2000:],
    }


def compile_1b() -> list[dict[str, Any]]:
    """Part 2a: `parc.compile` alone on 8 gloo ranks (bench/_compile_only.py under
    torchrun): each rank's seconds and `ru_maxrss` once compiled, no step."""
    env = {**os.environ, **SIZES_1B, "OMP_NUM_THREADS": "1", **MALLOC}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "dp8_zero3.par"
        spec.write_text(SPEC)
        argv = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={WORLD}"]
        argv += [str(BENCH / "_compile_only.py"), str(spec), str(BENCH / "_large_llama.py")]
        argv += [str(BATCH_1B)]
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        _guarded_wait(proc, time.perf_counter())
        output = proc.stdout.read() if proc.stdout else ""
    ranks = [json.loads(line) for line in output.splitlines() if line.startswith('{"rank"')]
    if proc.returncode != 0 or len(ranks) != WORLD:
        raise RuntimeError(
            f"the compile-only run failed (exit {proc.returncode}):\n{output[-3000:]}"
        )
    return sorted(ranks, key=lambda r: r["rank"])


def estimate_1b() -> dict[str, Any]:
    """The estimate of the 1B plan (analysed on meta here), for comparison."""
    from parc.compiler.frontend import analyse
    from parc.dsl import parse_spec
    from parc.runtime.equivalence import model_env

    with model_env(SIZES_1B):
        analysis = analyse(parse_spec(SPEC), str(BENCH / "_large_llama.py"), batch=BATCH_1B)
    params = sum(p.numel() for p in analysis.model.parameters())
    return {
        "params": params,
        "host": analysis.estimate.host[0].total,
        "device_peak": analysis.estimate.memory[0].peak,
    }


def section_1b(
    run: Mapping[str, Any], est: Mapping[str, Any], compiled: list[dict[str, Any]]
) -> str:
    peaks = {int(r): b for r, b in run["peaks"].items()}
    full = est["params"] * 4
    status = "ok" if run["code"] == 0 else f"exit {run['code']}"
    if run["stopped_low_memory"] is not None:
        status += f" (stopped: available memory fell to {gib(run['stopped_low_memory'])})"
    at = {int(r): t for r, t in run["peak_at"].items()}
    rows = [
        [
            str(c["rank"]),
            f"{c['seconds']:.0f} s",
            gib(c["rss_before"]),
            gib(c["ru_maxrss"]),
            gib(c["ru_maxrss"] - c["rss_before"]),
            gib(peaks[c["rank"]]) if c["rank"] in peaks else "-",
            f"{at[c['rank']]:.0f} s" if c["rank"] in at else "-",
        ]
        for c in compiled
    ]
    header = ["rank", "compile", "RSS before", "RSS after compile", "growth", "run peak", "at"]
    stepped = run["stepped_at"]
    loss = run["losses"][0]["loss"] if run["losses"] else None
    sizes = " ".join(f"{k}={v}" for k, v in SIZES_1B.items())
    growth = max(c["ru_maxrss"] - c["rss_before"] for c in compiled)
    lines = [
        "## 1B LLaMA-shaped, `mesh dp=8` + `zero 3`: `parc.compile` and one `parc run` step "
        "on 8 gloo ranks",
        "",
        f"Model `bench/_large_llama.py` (examples/llama.py's decoder, SGD) with `{sizes}`, "
        f"global batch {BATCH_1B}, `{' '.join(f'{k}={v}' for k, v in MALLOC.items())}`; "
        f"{est['params'] / 1e9:.2f}G parameters, {gib(full)} in fp32.",
        "",
        "Per rank: `parc.compile` alone (bench/_compile_only.py under torchrun: the "
        "deferred build and the rank's own tensors; `ru_maxrss` after imports and the "
        "process group, then after the compile, and the growth between), and the peak RSS "
        "of a separate `parc run --steps 1` (VmHWM polled from /proc, what `ru_maxrss` "
        "reports; compile and step together, and when it was reached):",
        "",
        md_table(header, rows),
        "",
        f"`parc run`: {status}; {run['seconds']:.0f} s in all"
        + (f", the step's loss ({loss:.4f}) logged at {stepped:.0f} s" if stepped else "")
        + f"; the sum of the ranks' peaks {gib(sum(peaks.values()))}. The estimate per rank: "
        f"host while compiling {gib(est['host'])} (measured growth at most {gib(growth)}), "
        f"device peak {gib(est['device_peak'])} (parameter and gradient shards, a gathered "
        "unit and its gradient, activations; gloo's own reduce-scatter copy and the "
        "interpreter with torch, ~0.35 GiB, come on top). A full-model build on every rank "
        f"(`parc.compile` before issue 14) would hold 8 × {gib(full)} = {gib(8 * full)} of "
        "fp32 weights alone, more than this machine's memory.",
    ]
    return "\n".join(lines)


# -- the file -------------------------------------------------------------------------------


def write_results(sections: list[str]) -> None:
    facts = machine()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        "# parc large-model measurements",
        "",
        f"Written by `bench/large_model.py` on {when} (not part of `make bench`; rerun it "
        "to refresh). Machine: "
        + ", ".join(f"{k} {v}" for k, v in facts.items())
        + " (load: averages over 1, 5, 15 min when written; the machine is shared, so "
        "wall times move with it).",
    ]
    RESULTS.write_text("\n\n".join(["\n".join(head), *sections]) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)


def _cli(argv: list[str]) -> int:
    parts = set(argv) or {"analyse", "run"}
    sections = []
    if "analyse" in parts:
        sections.append(section_20b(analyse_20b()))
        print(sections[-1], flush=True)
    if "run" in parts:
        compiled = compile_1b()
        run = run_1b()
        sections.append(section_1b(run, estimate_1b(), compiled))
        print(sections[-1], flush=True)
        if run["code"] != 0:
            print(run["output_tail"], file=sys.stderr)
    if not argv:
        write_results(sections)
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
