#!/usr/bin/env bash
# GPU readiness (issue 19, item 4): bench/gpu_check.py in one guarded call.
#
#   bench/gpu_check.sh                         # one GPU: at most 8 minutes; writes bench/RESULTS.md
#   bench/gpu_check.sh --dry-run --out X.md    # the same code on the CPU, tiny sizes, < 1 minute
#
# PYTHON overrides the interpreter (default: the repository's .venv). The real run is
# killed after 8 minutes (gpu_check.py starts nothing new after ~7.3 and rewrites its
# section after every measurement, so what it measured stays written).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"

dry_run=0
for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then
        dry_run=1
    fi
done

# No cd: a relative --out is the caller's; gpu_check.py finds the repository by its own path.
if [[ "$dry_run" == 1 ]]; then
    exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
fi
exec timeout --signal=TERM --kill-after=10 480 "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
