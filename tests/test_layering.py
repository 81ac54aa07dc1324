"""The compiler never imports the runtime: compiling needs no process group code.

Graph ops that passes insert live in the leaf package `parc.compiler.ops`
(docs/architecture.md, Runtime); the runtime imports them, not the reverse.
Checked in a fresh interpreter, since this test session has imported the
runtime already.
"""

from __future__ import annotations

import subprocess
import sys

# Imports every module under parc.compiler (subpackages included), then lists the
# parc.runtime modules that got loaded on the way.
_PROBE = """
import importlib, pkgutil, sys
import parc.compiler
names = [m.name for m in pkgutil.walk_packages(parc.compiler.__path__, "parc.compiler.")]
for name in names:
    importlib.import_module(name)
assert any(n.startswith("parc.compiler.passes.") for n in names), names
assert any(n.startswith("parc.compiler.planner.") for n in names), names
print(len(names))
print(" ".join(sorted(m for m in sys.modules if m.split(".")[:2] == ["parc", "runtime"])))
"""


def test_importing_every_compiler_module_loads_no_runtime_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    count, _, loaded = proc.stdout.partition("\n")
    assert int(count) > 50, proc.stdout  # the walk found the whole package
    assert loaded.split() == [], f"parc.compiler imports the runtime: {loaded.strip()}"
