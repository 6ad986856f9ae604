"""``pdserve serve``'s flags come from the config model: every field is reachable, vLLM's
names work, and what a flag sets is what the config holds."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from services.cli import build_parser
from services.config import ServeConfig, load_config
from services.config_flags import flag_paths, overrides
from services.gateway.gateway import Gateway


def _fields(model: type[BaseModel], path: str = "") -> set[str]:
    out: set[str] = set()
    for name, f in model.model_fields.items():
        ann = f.annotation
        nested = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        sub = [a for a in nested if issubclass(a, BaseModel)]
        out |= _fields(sub[0], f"{path}{name}.") if sub else {f"{path}{name}"}
    return out


def _serve(*argv: str) -> ServeConfig:
    args = build_parser().parse_args(["serve", *argv])
    return load_config(None, overrides(args), environ={})


def test_every_config_field_has_a_flag():
    assert set(flag_paths()) == _fields(ServeConfig)


def test_flags_of_every_kind_reach_the_config():
    cfg = _serve(
        "--max-model-len", "512",
        "--served-model-name", "smol",
        "--api-key", "k0",  # vLLM's name for auth_token
        "--dtype", "float32",
        "--quantization", "none",
        "--kv-cache-dtype", "int8",
        "--prefill-kv-blocks", "64",  # the earlier hand-written name
        "--decode-num-kv-blocks", "128",
        "--batch-invariant", "false",
        "--no-kv-streaming",
        "--gpu-memory-utilization", "none",
        "--api-keys", '{"team-a": "k1"}',
        "--decode-autoscaling-target-s", "0.05",
        "--address", "ray://head:10001",
    )  # fmt: skip
    assert (cfg.max_model_len, cfg.served_model_name, cfg.dtype) == (512, "smol", "float32")
    assert cfg.auth_token is not None and cfg.auth_token.get_secret_value() == "k0"
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("none", "int8")
    assert (cfg.prefill.num_kv_blocks, cfg.decode.num_kv_blocks) == (64, 128)
    assert cfg.batch_invariant is False and cfg.kv_streaming is False
    assert cfg.gpu_memory_utilization is None
    assert cfg.api_keys["team-a"].get_secret_value() == "k1"
    assert cfg.decode.autoscaling is not None and cfg.decode.autoscaling.target_s == 0.05
    assert cfg.ray_address == "ray://head:10001"
    untouched = _serve()
    assert untouched == load_config(None, {}, environ={})  # no flag, no override


def test_bad_flag_values_exit_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        _serve("--dtype", "float64")
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve("--batch-invariant", "maybe")


def test_max_model_len_is_checked_against_the_pools_kv_capacity():
    with pytest.raises(ValidationError, match="max_model_len 4096 does not fit the KV cache"):
        _serve("--max-model-len", "4096", "--decode-num-kv-blocks", "64")  # 64 x 16 = 1024
    cfg = _serve("--decode-num-kv-blocks", "64", "--prefill-num-kv-blocks", "64")
    gw = Gateway(None, None, cfg)  # type: ignore[arg-type]
    # the default (the model's 8192) capped to what one request can hold
    assert gw.max_model_len == 1024
    named = Gateway(None, None, cfg.model_copy(update={"served_model_name": "smol"}))  # type: ignore[arg-type]
    assert named.model_id == "smol"
