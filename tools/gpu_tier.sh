#!/usr/bin/env bash
# The GPU tier in one command (`make test-gpu`, and tools/gpu_run.sh's `tier` stage): every
# gpu-marked test and every page of the guide in GPU mode, in one pytest run whose last line is its
# summary, spread over pytest-xdist workers that each have a loopback of their own
# (tools/gpu_worker.py: the pages listen on fixed ports). Needs root (a network namespace per
# worker) and one CUDA device; its cost and needs are in docs/gpu-ci.md.
#
#   bash tools/gpu_tier.sh [pytest args...]      GPU_WORKERS (default 8), PYTHON (default python3),
#                                               TIER_PATHS (default tests: every gpu-marked test)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORKERS=${GPU_WORKERS:-8}
export WCACHE_RUN_GPU_BLOCKS=1 PYTHONUNBUFFERED=1
# Each checkpoint the tests read is written once and shared by the workers (tests/conftest.py).
WCACHE_TEST_CHECKPOINTS=$(mktemp -d "${TMPDIR:-/tmp}/wcache-gpu-tier.XXXXXX")
export WCACHE_TEST_CHECKPOINTS
trap 'rm -rf "$WCACHE_TEST_CHECKPOINTS"' EXIT
if [ "$WORKERS" -le 1 ] || [ "$(id -u)" != 0 ]; then
  [ "$(id -u)" = 0 ] || echo "gpu_tier.sh: not root, so no network namespace per worker: one worker, one page after another" >&2
  "$PY" -m pytest ${TIER_PATHS:-tests} -m gpu -p no:cacheprovider -v -rfEs --durations=40 "$@"
  exit
fi
"$PY" -m pytest ${TIER_PATHS:-tests} -m gpu -p no:cacheprovider --dist loadgroup \
  --tx "$WORKERS*popen//python=$PY $PWD/tools/gpu_worker.py" -v -rfEs --durations=40 "$@"
