"""What bench/gpu_check.py runs: the sizes of the real run on a GPU and of `--dry-run`.

The real run fits one call of at most 8 minutes on one H200 (bench/gpu_check.sh's
`timeout`); the dry run is the same code on the CPU at sizes that take well under
a minute on 2 cores, with a fixed memory budget in place of the GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["DRY", "REAL", "STEP_SPEC", "Knob", "Settings", "Workload"]

# The step-time part trains one rank in bf16: parc's program of this spec against the plain
# training step (torch.autocast bf16 over fp32 parameters, AdamW: the model files'
# default optimizer on every arm).
STEP_SPEC = "mesh dp=1\nprecision bf16\n"


class Knob(str, Enum):
    """What a workload's size is derived from the memory budget by."""

    BATCH = "batch"  # the global batch (the architecture is fixed)
    LAYERS = "layers"  # the number of layers (the batch is fixed)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """One model of the step-time part and how its size follows the budget."""

    name: str
    """As the tables print it."""
    model_file: str
    """Relative to the repository root."""
    env: dict[str, str]
    """The model file's size variables, the knob's excepted."""
    knob: Knob
    seq: int
    """Tokens per sample (what the model file's sample_batch makes)."""
    batch: int = 1
    """The global batch when the knob is the layer count."""
    layers_var: str = ""
    """The environment variable of the layer count (knob LAYERS)."""
    limit: int = 256
    """The largest knob value the sizing may choose."""

    def __post_init__(self) -> None:
        if self.knob is Knob.LAYERS and not self.layers_var:
            raise ValueError(f"workload {self.name!r}: knob layers needs layers_var")

    def at(self, value: int) -> tuple[dict[str, str], int]:
        """The environment and global batch of this workload at knob `value`."""
        if self.knob is Knob.BATCH:
            return dict(self.env), value
        return {**self.env, self.layers_var: str(value)}, self.batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """One mode of gpu_check.py (real or dry run)."""

    dry_run: bool
    equivalence_env: dict[str, str]
    """The example models' sizes for part 1 (every spec's model reads its own)."""
    equivalence_steps: int = 3
    workloads: tuple[Workload, ...] = field(default=())
    warmup: int = 3
    """Untimed steps before the timed ones (a compiled arm compiles in the first)."""
    timed: int = 10
    budget_fraction: float = 0.6
    """Of the GPU's total memory, what parc's estimate of a workload should come to."""
    fixed_budget: int | None = None
    """Bytes, in place of the fraction (the dry run: there is no GPU to measure)."""
    compile_backend: str = "inductor"
    deadline_s: float | None = 440.0
    """Seconds after the start past which nothing new starts; below the shell's
    8-minute `timeout`, so that the section still gets written."""

    def __post_init__(self) -> None:
        if not 0 < self.budget_fraction < 1:
            raise ValueError(f"budget_fraction {self.budget_fraction} must be in (0, 1)")
        if self.timed < 1:
            raise ValueError(f"timed steps {self.timed}: at least 1 is needed for a median")


# fmt: off
# The 48-layer GPT of bench/compile_time.py (bench/gpt48_tp_pp.par's model).
_GPT48 = {"GPT_LAYERS": "48", "GPT_DIM": "1024", "GPT_HEADS": "16", "GPT_VOCAB": "50304",
          "GPT_SEQ": "1024"}

# bench/_gpu_llama.py's defaults, written out so that the section says them.
_LLAMA = {"GPU_LLAMA_HIDDEN": "2048", "GPU_LLAMA_HEADS": "16", "GPU_LLAMA_KV_HEADS": "8",
          "GPU_LLAMA_FFN": "5632", "GPU_LLAMA_VOCAB": "32000", "GPU_LLAMA_SEQ": "2048"}

REAL = Settings(
    dry_run=False,
    equivalence_env={
        "GPT_LAYERS": "4", "GPT_DIM": "128", "GPT_HEADS": "4", "GPT_VOCAB": "256",
        "GPT_SEQ": "64", "LLAMA_LAYERS": "4", "LLAMA_DIM": "128", "LLAMA_HEADS": "4",
        "LLAMA_KV_HEADS": "2", "LLAMA_FFN": "352", "LLAMA_VOCAB": "256", "LLAMA_SEQ": "64",
        "MLP_LAYERS": "4", "MLP_DIM": "128",
    },
    workloads=(
        Workload(name="GPT 48 × 1024", model_file="examples/gpt.py", env=_GPT48,
                 knob=Knob.BATCH, seq=1024),
        Workload(name="HF Llama 2048 wide", model_file="bench/_gpu_llama.py", env=_LLAMA,
                 knob=Knob.LAYERS, seq=2048, batch=8, layers_var="GPU_LLAMA_LAYERS",
                 limit=128),
    ),
)

DRY = Settings(
    dry_run=True,
    equivalence_env={
        "GPT_LAYERS": "4", "GPT_DIM": "64", "GPT_HEADS": "4", "GPT_VOCAB": "64",
        "GPT_SEQ": "16", "LLAMA_LAYERS": "4", "LLAMA_DIM": "64", "LLAMA_HEADS": "4",
        "LLAMA_KV_HEADS": "2", "LLAMA_FFN": "128", "LLAMA_VOCAB": "64", "LLAMA_SEQ": "16",
        "MLP_LAYERS": "4", "MLP_DIM": "32",
    },
    workloads=(
        Workload(name="GPT 2 × 64 (dry run)", model_file="examples/gpt.py",
                 env={"GPT_LAYERS": "2", "GPT_DIM": "64", "GPT_HEADS": "4",
                      "GPT_VOCAB": "256", "GPT_SEQ": "32"},
                 knob=Knob.BATCH, seq=32, limit=8),
        Workload(name="HF Llama (dry run)", model_file="bench/_gpu_llama.py",
                 env={"GPU_LLAMA_HIDDEN": "64", "GPU_LLAMA_HEADS": "4",
                      "GPU_LLAMA_KV_HEADS": "2", "GPU_LLAMA_FFN": "128",
                      "GPU_LLAMA_VOCAB": "256", "GPU_LLAMA_SEQ": "32"},
                 knob=Knob.LAYERS, seq=32, batch=4, layers_var="GPU_LLAMA_LAYERS", limit=4),
    ),
    warmup=1,
    timed=2,
    fixed_budget=3 * 2**20,
    # Inductor's C++ code generation takes ~10 s per model on 2 cores; aot_eager runs the
    # same torch.compile path (Dynamo, AOT autograd) without it.
    compile_backend="aot_eager",
    deadline_s=None,
)
# fmt: on
