#!/usr/bin/env bash
# Regenerates the Python code for proto/ (never edit the generated files by hand;
# tests/kvtransfer/test_grpc_transport.py fails when they are stale).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for f in proto/pdserve/v1/*.proto; do
  .venv/bin/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. "$f"
done
