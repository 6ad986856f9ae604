#!/usr/bin/env bash
# Runs the whole test suite (sets up .venv first if needed). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./deploy/setup.sh
# NOTE: one torch thread per process; on a 2-core machine two threads run 10-20x slower as soon
# as another process wants a core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
.venv/bin/ruff check services kvtransfer tests bench client --extend-exclude '*_pb2*'
.venv/bin/ruff format --check --quiet --extend-exclude '*_pb2*' services kvtransfer tests bench client
exec .venv/bin/python -m pytest "$@"
