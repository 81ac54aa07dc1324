"""transformers and safetensors are test dependencies, never runtime ones.

In a process where importing either fails, parc still compiles plain models, both
through torch.fx and through the torch.export capture.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

SCRIPT = """
import sys
sys.modules["transformers"] = None  # `import transformers` raises ImportError
sys.modules["safetensors"] = None
from parc.compiler.frontend import analyse
for model in ("examples/gpt.py", "tests/models/assert_on_type.py"):
    a = analyse("specs/mlp_dp.par", model)
    print(model, a.gm.meta["parc_capture"])
assert "transformers" not in {m for m, v in sys.modules.items() if v is not None}
"""


def test_parc_compiles_plain_models_without_transformers_installed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "examples/gpt.py fx" in done.stdout
    assert "tests/models/assert_on_type.py export" in done.stdout
