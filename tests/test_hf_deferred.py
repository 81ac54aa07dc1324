"""A Hugging Face model built by `AutoModelForCausalLM.from_config` on meta initialises
as its CPU build does, also when transformers imports its model code lazily, during
the build (compiler/init_tables.py).

In a fresh interpreter: the model file imports only `AutoConfig` and
`AutoModelForCausalLM`, so `transformers.modeling_utils` and
`transformers.initialization` would first be imported inside the recording.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).parent.parent

# Records `build` on meta, builds it on the CPU from the same seed, and prints which
# parameters differ and which of transformers' initialisers are not torch's own.
_REPLAY = """
from parc.compiler.deferred_init import record_build
deferred = record_build(build, 0)
deferred.check()
torch.manual_seed(0)
reference = build()
differ = [n for n, p in reference.named_parameters() if not torch.equal(deferred.value(n), p)]
import transformers.initialization as hf_init
kept = [n for n, f in hf_init.TORCH_INIT_FUNCTIONS.items() if f is not getattr(torch.nn.init, n)]
print("differ", differ, "kept", kept)
"""

OUTSIDE = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
assert "transformers.modeling_utils" not in sys.modules  # imported lazily, by the build
cfg = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
build = lambda: AutoModelForCausalLM.from_config(cfg)
"""

INSIDE = """
import sys, torch
def build():
    from transformers import AutoConfig, AutoModelForCausalLM  # only inside the build
    cfg = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    return AutoModelForCausalLM.from_config(cfg)
"""


def _run(script: str) -> str:
    """`script`'s stdout in a fresh interpreter (it must succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_from_config_on_meta_replays_the_cpu_build_bitwise() -> None:
    out = _run(OUTSIDE + _REPLAY)
    # Nothing differs, and transformers' table of initialisers holds torch's own again.
    assert "differ [] kept []" in out, out


def test_a_library_first_imported_inside_build_model_is_recorded_too() -> None:
    # The first build imports the tables unpatched; record_build builds once more.
    out = _run(INSIDE + _REPLAY)
    assert "differ [] kept []" in out, out


META_FIRST = """
import torch
from parc.compiler.model import load_model
source = load_model("tests/models/hf/auto_llama.py")
source.build(device="meta")  # the front end's build: initialisers are no-ops meanwhile
torch.manual_seed(0)
after = source.build()
import transformers.initialization as hf_init
kept = [n for n, f in hf_init.TORCH_INIT_FUNCTIONS.items() if f is not getattr(torch.nn.init, n)]
torch.save({n: p.detach() for n, p in after.named_parameters()}, "{out}")
print("kept", kept)
"""

CPU_ONLY = """
import torch
from parc.compiler.model import load_model
torch.manual_seed(0)
model = load_model("tests/models/hf/auto_llama.py").build()
torch.save({n: p.detach() for n, p in model.named_parameters()}, "{out}")
"""


def test_a_meta_build_leaves_the_next_cpu_build_initialised(tmp_path: Path) -> None:
    # parc check builds on meta (the report) and then the reference on the CPU, in one
    # process: transformers' table, filled during the meta build, kept the no-ops and
    # the reference trained from torch's default init instead of the model's.
    import torch

    outs = []
    for i, script in enumerate((META_FIRST, CPU_ONLY)):
        out = tmp_path / f"{i}.pt"
        printed = _run(script.replace("{out}", str(out)))
        outs.append(torch.load(out))
        if script is META_FIRST:
            assert "kept []" in printed, printed  # torch's own initialisers again
    assert all(torch.equal(outs[0][n], outs[1][n]) for n in outs[1]), "the CPU builds differ"
