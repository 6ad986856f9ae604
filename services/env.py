"""The one registry of pdserve's environment variables (all prefixed ``PDSERVE_``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


CACHE_DIR = EnvVar(
    "PDSERVE_CACHE_DIR",
    str(Path.home() / ".cache" / "pdserve"),
    "where GGUF files are converted (config, tokenizer, fp32 weights when dequantized); may "
    "be shared between pods",
)
GPU = EnvVar("PDSERVE_GPU", "0", "deploy/setup.sh: 1 installs the CUDA build of torch and Triton")
BENCH = EnvVar(
    "PDSERVE_BENCH", "0", "deploy/setup.sh: 1 also installs the benchmarks' llama.cpp anchor"
)

AUTH_TOKEN = EnvVar(
    "PDSERVE_AUTH_TOKEN",
    "",
    "the bearer token the APIs require (read by the config loader as the auth_token field) "
    "and the one `pdserve client` sends",
)
API_KEYS = EnvVar(
    "PDSERVE_API_KEYS",
    "",
    'tenant name -> bearer key as JSON ({"team-a": "...", ...}; read by the config loader as '
    "the api_keys field): each tenant's prefix cache is its own",
)
TARGET = EnvVar("PDSERVE_TARGET", "127.0.0.1:50051", "`pdserve client`: the gRPC API to call")

REGISTRY: tuple[EnvVar, ...] = (CACHE_DIR, GPU, BENCH, AUTH_TOKEN, API_KEYS, TARGET)
