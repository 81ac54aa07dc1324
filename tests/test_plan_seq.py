"""`parc plan --seq N` on a model whose batches are longer: sequence parallel must
split the model file's own sequence too.

`--seq` plans at a shorter sequence by slicing the sample inputs, but the spec `parc
plan` writes is checked by its `# check:` line (and trained) with the model file's
batches. A probe found `--seq 16` on a model of sequence 30 planning `sequence_parallel`
at tp=4, whose own `# check:` line then failed (30 is not divisible by 4). Sequence
parallel is now profiled only at tp sizes that divide both (compiler/planner/
model_profile.py).
"""

from __future__ import annotations

from helpers import GPT

from parc.compiler.model import load_model
from parc.compiler.planner.model_profile import profile_model
from parc.runtime.equivalence import model_env

ENV = {"GPT_LAYERS": "2", "GPT_DIM": "32", "GPT_HEADS": "4", "GPT_VOCAB": "64"}


def test_sequence_parallel_needs_tp_to_divide_the_model_files_sequence() -> None:
    with model_env({**ENV, "GPT_SEQ": "30"}):
        short = profile_model(load_model(GPT), gpus_per_node=4, seq=16)
    assert set(short.tp) == {1, 2, 4}  # tp=4 splits the Linears either way
    assert set(short.sequence) == {2}  # 16 and 30 both divide by 2; 30 not by 4
    with model_env({**ENV, "GPT_SEQ": "32"}):
        native = profile_model(load_model(GPT), gpus_per_node=4, seq=16)
    assert set(native.sequence) == {2, 4}
