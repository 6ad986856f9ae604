"""GGUF loading: a tiny random Llama written as GGUF the way llama.cpp's converter writes it
(q/k rows permuted for its RoPE), in every supported tensor type, loads back to HF's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.loader import load_model
from services.engine.sampling_params import SamplingParams
from tests.fixtures import hf_greedy

# max |error| / max |w| allowed per type (quantization error, not a layout bug: a wrong
# permutation or transposition gives errors of order 1)
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, hf_folder, qtype_name: str, extra: dict | None = None) -> None:
    import gguf
    from safetensors.torch import load_file

    from services.engine.loader import _GGUF_NAMES

    cfg = load_model(hf_folder).config
    sd = load_file(str(hf_folder / "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_eos_token_id(2)
    inverse = {v: k for k, v in _GGUF_NAMES.items()}
    for name, t in sd.items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{inverse['.'.join(rest[:-1])]}.{rest[-1]}"
        if name.endswith("q_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_kv_heads)
        if arr.ndim == 1:  # norms stay F32, as llama.cpp writes them
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for gname, arr in (extra or {}).items():  # e.g. rope_freqs, as llama.cpp writes it
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_gguf_types_load_to_the_hf_weights(qtype, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama-mha-untied")
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, folder, qtype)
    ours = load_model(path)
    ref = load_model(folder)
    assert ours.config.num_heads == ref.config.num_heads and not ours.config.tie_word_embeddings
    for name, want in ref.state_dict.items():
        got = ours.state_dict[name]
        assert got.shape == want.shape, name
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err <= TOLERANCE[qtype], (name, err)
    if qtype == "F32":  # bit-exact weights: tokens equal HF's on the original model
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        eng = Engine(ours, None, EngineConfig(num_kv_blocks=64, block_size=4, dtype="float32"))
        prompt = [5, 17, 99, 200, 3, 42]
        assert eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0] == hf_greedy(
            hf, prompt, 16, eos=2
        )


def test_gguf_of_another_architecture_is_refused(tmp_path):
    import gguf

    from services.engine.errors import UnsupportedArchitectureError

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        load_model(path)


def test_a_conversion_reports_its_progress(tiny_model_dir, tmp_path, monkeypatch, caplog):
    import logging

    from services.engine import loader

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "PROGRESS_EVERY_S", 0.0)  # every tensor
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model_dir("llama-mha-untied"), "Q8_0")
    with caplog.at_level(logging.INFO, logger="services.engine.loader"):
        loader.resolve_model(path)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"converting {path}") and lines[-1].startswith("converted tiny.gguf")
    assert any("tensors," in line for line in lines[1:-1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="services.engine.loader"):
        loader.resolve_model(path)  # cached: nothing to convert, nothing said
    assert not caplog.records


def test_the_cache_entry_is_named_by_content(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import shutil

    from services.engine import loader

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a = tmp_path / "a" / "tiny.gguf"
    a.parent.mkdir()
    write_gguf(a, tiny_model_dir("llama-mha-untied"), "Q8_0")
    b = tmp_path / "b" / "tiny.gguf"  # another pod's download: same bytes, its own mtime
    b.parent.mkdir()
    shutil.copyfile(a, b)
    os.utime(b, (1, 1))
    assert loader.gguf_cache_folder(a) == loader.gguf_cache_folder(b)
    with open(b, "r+b") as f:  # one byte of the last tensor differs
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert loader.gguf_cache_folder(a) != loader.gguf_cache_folder(b)


def test_a_quantized_load_writes_no_fp32_copy(tiny_model_dir, tmp_path, monkeypatch):

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model_dir("llama-mha-untied"), "Q8_0")
    loaded = load_model(path, keep_quantized=True)
    assert (loaded.folder / "config.json").is_file()
    assert not (loaded.folder / "model.safetensors").exists()
    assert load_model(path).folder == loaded.folder  # a dequantizing load adds the weights
    assert (loaded.folder / "model.safetensors").is_file()


def test_a_second_process_waits_for_the_conversion_and_reads_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Pods sharing the cache: while one converts under the entry's lock, another waits, then
    finds the weights and converts nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from services.engine import loader
    from tests.fixtures import eventually

    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model_dir("llama-mha-untied"), "Q8_0")
    folder = loader.gguf_cache_folder(path)
    log = tmp_path / "other.log"
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
        "from services.engine.loader import resolve_model; "
        f"print(resolve_model({str(path)!r})[0])"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
    with loader._entry_lock(folder):
        with open(log, "w") as err:
            other = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, env=env, text=True
            )
        try:
            eventually(lambda: "waiting for another process" in log.read_text(), 60, "the wait")
            loader._convert_gguf(path, folder, weights=True)  # this "pod" converts
        except BaseException:
            other.kill()
            raise
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0 and Path(out.strip()) == folder
    assert f"converting {path}" not in log.read_text()  # it waited, then read
    assert (folder / "model.safetensors").is_file()


def _llama_cpp_rope_freqs(cfg) -> np.ndarray:  # type: ignore[no-untyped-def]
    """What llama.cpp's converter writes for a llama3-scaled model: per-frequency divisors."""
    rs = cfg.rope_scaling
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    wavelen = 2 * np.pi / inv
    low, high = (
        rs.original_max_position_embeddings / rs.low_freq_factor,
        (rs.original_max_position_embeddings / rs.high_freq_factor),
    )
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    mid = 1 / ((1 - smooth) / rs.factor + smooth)
    out = np.where(wavelen < high, 1.0, np.where(wavelen > low, rs.factor, mid))
    return out.astype(np.float32)


def test_a_gguf_s_rope_freqs_are_honoured(tiny_model_dir, tmp_path, monkeypatch):
    """Llama-3.1 / 3.2 GGUFs carry their rope scaling as a rope_freqs tensor only: the engine
    applies it, and its tokens equal transformers' on the llama3-scaled original."""
    from transformers import AutoModelForCausalLM

    from services.engine.rope import inv_frequencies

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama3-rope-scaled")
    ref_cfg = load_model(folder).config
    freqs = _llama_cpp_rope_freqs(ref_cfg)
    assert len(set(freqs.tolist())) > 2  # plateau, ramp and unscaled frequencies all present
    path, plain = tmp_path / "scaled.gguf", tmp_path / "plain.gguf"
    write_gguf(path, folder, "F32", {"rope_freqs.weight": freqs})
    write_gguf(plain, folder, "F32")
    ours = load_model(path)
    assert ours.config.rope_scaling.rope_type == "freq_factors"
    torch.testing.assert_close(inv_frequencies(ours.config), inv_frequencies(ref_cfg))
    assert not torch.allclose(inv_frequencies(load_model(plain).config), inv_frequencies(ref_cfg))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eng = Engine(ours, None, EngineConfig(num_kv_blocks=64, block_size=4, dtype="float32"))
    prompt = list(range(3, 60))  # past original_max_position_embeddings (64) when done
    got = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert got == hf_greedy(hf, prompt, 16, eos=None)
