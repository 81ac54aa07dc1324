"""bench/gpu_check.sh, the GPU readiness check: its `--dry-run` (the same code on the CPU at
tiny sizes) passes here, and its section goes into bench/RESULTS.md without touching the rest.

The dry run is one subprocess (~30 s on 2 cores, most of it the 14 specs' equivalence
runs and the imports); its timings are printed, never judged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SPECS = sorted((ROOT / "specs").glob("*.par"))
ARMS = ("parc eager", "parc compiled", "native eager", "native compiled")
WORKLOADS = ("GPT 2 × 64 (dry run)", "HF Llama (dry run)")
TIMEOUT_S = 240  # the dry run takes ~30 s; far past that it hangs

sys.path.insert(0, str(ROOT / "bench"))
from _gpu_section import replace_section  # noqa: E402  (bench/ is not a package)


def _subsection(section: str, title: str) -> str:
    """The text under `### title` up to the next `### ` heading."""
    after = section.split(f"### {title}\n", 1)[1]
    return after.split("\n### ", 1)[0]


def _rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in `text` (header and alignment rows left out),
    as cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    aligns = {i for i, row in enumerate(cells) if all(set(c) <= {"-", ":"} for c in row)}
    return [row for i, row in enumerate(cells) if i not in aligns and i + 1 not in aligns]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str]:
    """`bench/gpu_check.sh --dry-run --out <tmp>` into a file that already has other text:
    its exit code, the file and what it printed."""
    out = tmp_path_factory.mktemp("gpu") / "RESULTS.md"
    out.write_text("# results\n\nkept as it is\n")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return done.returncode, out.read_text(), done.stderr


def test_the_dry_run_exits_0_and_keeps_the_rest_of_the_file(
    dry_run: tuple[int, str, str],
) -> None:
    code, text, err = dry_run
    assert code == 0, f"{err[-3000:]}\n{text}"
    assert text.startswith("# results\n\nkept as it is\n\n## GPU\n")
    assert "**Dry run**" in text and "Status: **ok**" in text


def test_every_spec_has_an_equivalence_row_and_each_is_ok(dry_run: tuple[int, str, str]) -> None:
    _, text, _ = dry_run
    rows = _rows(_subsection(text, "Equivalence at world 1"))
    assert sorted(r[0] for r in rows) == [str(s.relative_to(ROOT)) for s in SPECS]
    assert [r[0] for r in rows if r[3] != "ok"] == []
    # A statement world 1 refuses is reported with its line, e.g. sequence_parallel.
    assert "`specs/gpt_3d_sp.par:9` `sequence_parallel tp`:" in text


def test_every_workload_has_a_step_and_a_memory_row_per_arm(dry_run: tuple[int, str, str]) -> None:
    _, text, _ = dry_run
    steps = _rows(_subsection(text, "bf16 step time and MFU"))
    memory = _rows(_subsection(text, "Memory: parc's estimate against the measured peak"))
    wanted = [(w, a) for w in WORKLOADS for a in ARMS]
    assert [(r[0], r[3]) for r in steps] == wanted
    assert [(r[0], r[1]) for r in memory] == wanted
    assert all(r[4].endswith(" ms") and r[7] == "n/a (CPU)" for r in steps), steps
    assert all(r[2].endswith("B") and r[3] == "n/a (CPU)" for r in memory), memory


def test_the_section_replaces_only_its_own_part_of_a_file() -> None:
    before = "# title\n\n<!-- bench:a | x | 1 s | ok -->\n## A\n\nbody\n<!-- /bench:a -->\n"
    after = "<!-- bench:b | x | 1 s | ok -->\n## B\ntail without a newline"
    old = "## GPU\n\nold figures\n\n### Memory\n\nmore\n\n"
    new = "## GPU\n\nnew figures\n"
    assert replace_section(before + old + after, new) == before + new + "\n" + after
    # No section yet: appended after a blank line; once there, replaced in place.
    appended = replace_section(before, new)
    assert appended == before + "\n" + new
    assert replace_section(appended, "## GPU\n\nagain\n") == before + "\n## GPU\n\nagain\n"
    assert replace_section("", new) == new
    # `### GPU` or `## GPUs` is not the section.
    other = "## GPUs\n\nx\n### GPU\n"
    assert replace_section(other, new) == other + "\n" + new
