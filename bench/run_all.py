"""`make bench`: run the benchmarks in bench/ and rewrite bench/RESULTS.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/run_all.py          # every benchmark
    OMP_NUM_THREADS=1 .venv/bin/python bench/run_all.py dp tp    # these; keep the others' sections

A benchmark is a file `bench/<name>.py` (name not starting with `_`) that
defines a top-level `main() -> str` returning its markdown section, starting
with a `## ` heading, tables with parc/native ratios (lower is better) and
their targets; `python bench/<name>.py` prints that section. Files are found
by reading their source (nothing is imported here), run in ORDER and then in
name order, each in a fresh process (`import <name>; <name>.main()`) so that
their environment variables and worker pools cannot meet, with a time limit.
A failing benchmark gets a section with its error; the others still run.

Each section in RESULTS.md sits between `<!-- bench:<name> ... -->` and
`<!-- /bench:<name> -->` markers carrying when it ran, how long it took and
whether it succeeded, so a partial run replaces only its own sections.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import BENCH, PYTHON, ROOT, machine, md_table
from _gpu_section import replace_section, section_in

RESULTS = BENCH / "RESULTS.md"
ORDER = ("compile_time", "dp", "tp", "pp")  # first, in this order; then the rest by name
LIMIT_S = 600.0  # each benchmark should take well under 3 minutes; this catches a hang
_RUNNER = (
    "import sys; sys.path.insert(0, sys.argv[1]); import {name} as b; "
    "open(sys.argv[2], 'w').write(b.main())"
)
_MARK = re.compile(
    r"<!-- bench:(?P<name>\w+) \| (?P<when>[^|]*) \| (?P<took>[^|]*) \| (?P<status>[^>]*?) -->\n"
    r"(?P<body>.*?)\n<!-- /bench:(?P=name) -->",
    re.S,
)

__all__ = ["discover", "main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Section:
    """One benchmark's part of RESULTS.md."""

    name: str
    when: str  # UTC, minutes
    took: str  # wall time of its process
    status: str  # "ok", or why not
    body: str  # markdown, starting with its `## ` heading

    def render(self) -> str:
        head = f"<!-- bench:{self.name} | {self.when} | {self.took} | {self.status} -->"
        return f"{head}\n{self.body}\n<!-- /bench:{self.name} -->"


def discover() -> list[str]:
    """Names of the benchmarks in bench/, in run order."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name.startswith("_") or path.stem == "run_all":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found.append(path.stem)
    return sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_one(name: str) -> Section:
    """Run benchmark `name` in a fresh process; its section, or one that shows its error."""
    print(f"run_all: {name}", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory(prefix="parc-bench-") as tmp:
        out = Path(tmp) / "section.md"
        cmd = [str(PYTHON), "-c", _RUNNER.format(name=name), str(BENCH), str(out)]
        start, when = time.perf_counter(), _now()
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, timeout=LIMIT_S
            )
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
            error = done.stderr
        except subprocess.TimeoutExpired as exc:
            status, error = f"failed (over {LIMIT_S:.0f} s)", str(exc.stderr or "")
        took = f"{time.perf_counter() - start:.0f} s"
        sys.stderr.write(error)
        if status == "ok" and out.exists():
            return Section(name=name, when=when, took=took, status=status, body=out.read_text())
    tail = "\n".join(error.strip().splitlines()[-30:])
    body = f"## {name}: {status}\n\n`bench/{name}.py` produced no results:\n\n```\n{tail}\n```"
    return Section(name=name, when=when, took=took, status=status, body=body)


def _kept() -> dict[str, Section]:
    if not RESULTS.exists():
        return {}
    return {
        m["name"]: Section(
            name=m["name"],
            when=m["when"].strip(),
            took=m["took"].strip(),
            status=m["status"].strip(),
            body=m["body"],
        )
        for m in _MARK.finditer(RESULTS.read_text())
    }


def _header(sections: list[Section]) -> str:
    m = machine()
    rows = [
        [f"[{s.name}](#{_anchor(s.body)})", f"`bench/{s.name}.py`", s.when, s.took, s.status]
        for s in sections
    ]
    return "\n\n".join(
        [
            "# parc benchmarks",
            f"Written by `make bench` (`bench/run_all.py`) on {_now()}; do not edit by hand.",
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['os']}; Python {m['python']}, "
            f"torch {m['torch']}, `OMP_NUM_THREADS={m['omp']}`; load averages "
            f"(1, 5, 15 min) when written: {m['load']}. The machine is shared with other "
            "work: wall times move with its load, which is why parc and its native counterpart run "
            "interleaved in the same processes and ratios are the figures to read.",
            "Ratios are parc/native: **lower is better**; every table shows its target.",
            "Reproduce: `make bench` (every benchmark); "
            "`OMP_NUM_THREADS=1 .venv/bin/python bench/run_all.py dp` (some, keeping the "
            "other sections); `OMP_NUM_THREADS=1 .venv/bin/python bench/<name>.py` prints "
            "one section without writing this file.",
            md_table(["benchmark", "script", "measured", "took", "status"], rows),
        ]
    )


def _anchor(body: str) -> str:
    title = body.splitlines()[0].lstrip("#").strip().lower() if body else ""
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def main(argv: list[str]) -> int:
    names = discover()
    wanted = argv or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"run_all: no benchmark {unknown}; found {names}", file=sys.stderr)
        return 2
    sections = _kept()
    for name in wanted:
        sections[name] = run_one(name)
    ordered = [sections[n] for n in names if n in sections]
    text = "\n\n".join([_header(ordered), *(s.render() for s in ordered)]) + "\n"
    # bench/gpu_check.sh's section is not one of these benchmarks': kept as it was.
    gpu = section_in(RESULTS.read_text()) if RESULTS.exists() else None
    RESULTS.write_text(text if gpu is None else replace_section(text, gpu))
    print(f"run_all: wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0 if all(s.status == "ok" for s in ordered if s.name in wanted) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
