#!/usr/bin/env bash
# Regenerates the Python code for proto/ (never edit the generated files by hand; a test
# fails when they are stale):
# - kv_transfer.proto (internal, server side) -> next to it, package proto.pdserve.v1
# - generate.proto (the public API) -> client/pdserve/v1, package pdserve.v1 of the
#   pdserve-client distribution, so the SDK installs without the server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
protoc=(.venv/bin/python -m grpc_tools.protoc)
"${protoc[@]}" -I . --python_out=. --grpc_python_out=. --pyi_out=. proto/pdserve/v1/kv_transfer.proto
"${protoc[@]}" -I proto --python_out=client --grpc_python_out=client --pyi_out=client \
  proto/pdserve/v1/generate.proto
