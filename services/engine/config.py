"""Typed configuration of the model and the engine (frozen dataclasses: the inside of the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from services.engine.errors import ModelLoadError, UnsupportedArchitectureError

# HF `architectures` entry -> the flavour of Llama-family decoder it is.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # freq_factors only: each rotary frequency is divided by its factor (a GGUF's rope_freqs
    # tensor, as llama.cpp applies it: Llama-3.1 / 3.2 keep their llama3 scaling there)
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2 always; Llama when set)
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json``; refuses non-Llama-family architectures by name."""
        archs = cfg.get("architectures") or []
        arch_name = archs[0] if archs else str(cfg.get("model_type", "<missing>"))
        if arch_name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(arch_name, list(SUPPORTED_ARCHITECTURES))
        flavour = SUPPORTED_ARCHITECTURES[arch_name]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope_theta, scaling = _parse_rope(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = cfg.get("sliding_window")
            if flavour == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None
            return cls(
                architecture=flavour,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=flavour == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=flavour != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """Inverse of ``from_hf_dict`` (used for the dequantized GGUF cache, loadable by HF too)."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        rs = self.rope_scaling
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else None,
            "torch_dtype": "float32",
        }
        if rs.rope_type == "freq_factors":  # pdserve's own: transformers has no such type
            out["rope_scaling"] = {
                "rope_type": "freq_factors",
                "freq_factors": list(rs.freq_factors),
            }
        elif rs.rope_type != "default":
            out["rope_scaling"] = {
                "rope_type": rs.rope_type,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return out


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or {})
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "freq_factors":
        factors = scaling.get("freq_factors")
        if not isinstance(factors, list) or not all(
            isinstance(f, int | float) and f > 0 for f in factors
        ):
            raise ModelLoadError("rope_scaling freq_factors must be a list of positive numbers")
        return theta, RopeScaling(
            rope_type=rope_type, freq_factors=tuple(float(f) for f in factors)
        )
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


Role = Literal["both", "prefill", "decode"]
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # kv_cache_dtype (services.engine.kv_quant)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of one engine (one per replica)."""

    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 64
    # NOTE: per-step token budget; prompts longer than this are prefilled in chunks, so a long
    # prompt never stalls the decodes that share its steps for more than one budget's worth.
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    role: Role = "both"
    dtype: str = "auto"  # services.engine.precision: CPU fp32 (+ bf16 matmuls where native)
    device: str = "cpu"
    threads: int = 1
    # "auto": triton on CUDA, torch elsewhere (see services.engine.backend)
    attention_backend: str = "auto"
    # weights: "auto" keeps a GGUF's Q8_0/Q4_x weights quantized where pdserve's CPU kernels
    # build (float checkpoints stay float; CUDA dequantizes); "none" computes everything in
    # dtype; "int8" / "int4" quantize float weights on load (CPU, groups of 32)
    quantization: str = "auto"
    # KV cache storage: "auto" = the matrix products' dtype (bf16 on CPUs with native bf16
    # under dtype auto, else the model's); "float32" / "bfloat16" as named; "int8" = int8 with
    # a scale per 32 values (services.engine.kv_quant): a quarter of fp32's bytes
    kv_cache_dtype: str = "auto"
    # CUDA only: capture pure decode steps as CUDA graphs (needs a graph-safe backend)
    cuda_graphs: bool = True
    # CUDA only: size the KV pool from device memory (this fraction of the device for weights,
    # activations and KV together); None = exactly num_kv_blocks
    gpu_memory_utilization: float | None = 0.9
    # CPU: also keep oneDNN-packed weights for batched steps (about 2x the weight memory,
    # up to 2x faster batched decode and prefill); off keeps one copy
    prepack_weights: bool = True
    # each linear's kernel by the row's role (prompt or generated) instead of by the step's
    # size, so a request's tokens do not depend on its batch (services.engine.row_roles);
    # implemented with the ``cpu`` attention backend; "auto": on wherever that backend runs
    batch_invariant: bool | Literal["auto"] = "auto"
    # prompt-lookup speculative decoding: up to this many draft tokens per decode step, taken
    # from the request's own earlier tokens (services.engine.ngram); 0 = off. Lossless.
    speculative_tokens: int = 0
    prompt_lookup_max: int = 3  # longest tail n-gram looked up
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(
                f"EngineConfig.role must be both, prefill or decode, got {self.role!r}"
            )
        if self.speculative_tokens < 0 or not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "EngineConfig: speculative_tokens must be >= 0 and "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"EngineConfig.quantization must be one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.gpu_memory_utilization is not None and not (0 < self.gpu_memory_utilization <= 1):
            raise ValueError("EngineConfig.gpu_memory_utilization must be in (0, 1]")
