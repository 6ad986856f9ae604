"""What ``dtype: auto`` and ``quantization: auto`` mean on this machine, and the weights that
follow from them.

- dtype ``auto``: bfloat16 on CUDA. On CPU float32 activations (the format of pdserve's C
  kernels: fused decode step, attention, quantized linears) with the packed matrix products
  (prompts, large batches) and the KV cache's storage (``kv_quant.resolve_kv_dtype``) in
  bfloat16 where the CPU computes it natively (AVX512-BF16 or
  AMX: oneDNN's packed bf16 GEMM, 5-7x the fp32 GEMM's rate on one AMX core, 2.2x on a Zen 4
  core), float32 elsewhere (measured on AVX2: bf16 GEMMs 1.5-2x slower than fp32,
  BENCHMARKS.md); prompt attention in bf16 with AMX (SDPA, ``prompt_attention_dtype``) and,
  through the bf16 cache, with AVX512-BF16 (the cpu backend's prompt kernel).
  ``float32`` is fp32 everywhere (the reference);
  ``bfloat16`` is bf16 everywhere (activations and KV too, on the torch attention backend).
- quantization ``auto``: a GGUF's Q8_0 / Q4_x weights stay quantized on CPU when pdserve's
  kernels build here (they read 4-8x fewer bytes per decode step); float checkpoints stay float;
  on CUDA everything is dequantized (the kernels are CPU kernels).
"""

from __future__ import annotations

import torch

from services.engine.cpu_kernels import library
from services.engine.linear import Weight
from services.engine.quant import QuantWeight

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the HF names of weights that may be quantized (linears and the embedding / lm_head)
_EMBEDDINGS = ("embed_tokens.weight", "lm_head.weight")
_QUANTIZABLE = ("_proj.weight", *_EMBEDDINGS)


def cpu_has_native_bf16() -> bool:
    flags = library.cpu_flags()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_has_amx() -> bool:
    return "amx_bf16" in library.cpu_flags() and cpu_has_native_bf16()


def prompt_attention_dtype(matmul_dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype prompt attention (SDPA) computes in. On CPU under bf16 matmuls, bf16 only
    where AMX runs it: measured on one core, SDPA's bf16 kernel is 2.2x its fp32 one on AMX,
    but 0.9x on AVX512-BF16 alone (Zen 4; TTFT at 128 / 512 tokens 211 -> 189 / 908 -> 843 ms
    in fp32, and no casts around it)."""
    if torch.device(device).type == "cpu" and matmul_dtype == torch.bfloat16 and not cpu_has_amx():
        return torch.float32
    return matmul_dtype


def resolve_dtype(name: str, device: str) -> str:
    """``auto`` -> the fastest dtype whose results hold here; other names pass through."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
        return name
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def resolve_matmul_dtype(name: str, device: str) -> str:
    """The dtype of the packed matrix products (prefill, large batches) for ``dtype: name``."""
    if name == "auto" and torch.device(device).type == "cpu" and cpu_has_native_bf16():
        return "bfloat16"
    return resolve_dtype(name, device)


def resolve_quantization(name: str, device: str) -> str:
    """``auto`` -> ``keep`` (GGUF weights as they are) or ``none``; int8/int4 checked."""
    on_cuda = torch.device(device).type == "cuda"
    if name in ("int8", "int4"):
        if on_cuda:
            raise ValueError(
                f"quantization {name!r} runs on pdserve's CPU kernels; on CUDA use a bf16 model"
            )
        if library.load() is None:
            raise ValueError(f"quantization {name!r} needs {library.load_error()}")
        return name
    if name == "auto":
        return "none" if on_cuda or library.load() is None else "keep"
    return name


def prepare_weights(sd: dict[str, Weight], quantization: str) -> dict[str, Weight]:
    """The state dict in the resolved quantization (``keep``, ``none``, ``int8``, ``int4``)."""
    if quantization == "keep":
        return sd
    out: dict[str, Weight] = {}
    kind = {"int8": "q8", "int4": "q4"}.get(quantization)
    for name, w in sd.items():
        if kind is not None and name.endswith(_QUANTIZABLE) and w.shape[-1] % 32 == 0:
            # NOTE: the embedding (and a tied lm_head) stays 8-bit under int4: in 4 bits it
            # alone cost SmolLM2 18% of top-1 agreement (bench/quality_bench.py)
            want = "q8" if name.endswith(_EMBEDDINGS) else kind
            if isinstance(w, QuantWeight) and w.kind == want:
                out[name] = w
            else:
                dense = w.dequantize() if isinstance(w, QuantWeight) else w
                out[name] = QuantWeight.from_float(dense, want)  # type: ignore[arg-type]
        else:
            out[name] = w.dequantize() if isinstance(w, QuantWeight) else w
    return out
