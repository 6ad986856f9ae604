"""Bad input gets an exception naming the field, before any KV block is taken; the engine
keeps serving. Bad model files get a clear ModelLoadError."""

from __future__ import annotations

import json
import shutil

import pytest

from services.engine.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from services.engine.loader import load_model
from services.engine.sampling_params import SamplingParams

OK = SamplingParams(max_tokens=4, temperature=0)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=-3)),
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("seed", dict(seed="abc")),
        ("stop", dict(stop=5)),
        ("stop", dict(stop=["ok", 3])),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids="x")),
        ("temperature", dict(temperature=1e-38)),  # logits / 1e-38 overflow: NaN probabilities
        ("temperature", dict(temperature=float("inf"))),
        ("stop", dict(stop=["x"] * 40_000)),  # each is checked after every token
        ("stop", dict(stop=["y" * 10_000])),
        ("stop_token_ids", dict(stop_token_ids=list(range(65)))),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.create(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("field", "prompt", "params"),
    [
        ("prompt", [], OK),
        ("prompt", [1, 2, 999999], OK),
        ("prompt", [1, -1], OK),
        ("prompt", [1] * 512, OK),  # the tiny model's context is 512
        ("max_tokens", [1] * 500, SamplingParams(max_tokens=20)),
        ("max_tokens", [1, 2], SamplingParams(max_tokens=511)),  # over the context with the prompt
        ("stop", [1, 2], SamplingParams(max_tokens=3, stop=("x",))),  # tiny model: no tokenizer
    ],
)
def test_bad_requests_are_refused_and_others_continue(make_engine, field, prompt, params):
    eng = make_engine(num_kv_blocks=160)  # 640 tokens: the model's 512 is the context
    eng.add_request("good", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.step()
    used = eng.blocks.num_used_blocks
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", prompt, params)
    assert e.value.field == field
    assert eng.blocks.num_used_blocks == used
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert outs[-1].request_id == "good" and outs[-1].num_output_tokens == 6


def test_duplicate_request_id_is_refused(make_engine):
    eng = make_engine()
    eng.add_request("a", [5, 6], OK)
    with pytest.raises(InvalidRequestError, match="request_id"):
        eng.add_request("a", [5, 6], OK)
    assert eng.abort("a") and not eng.abort("a")
    (out,) = eng.step()
    assert out.finish_reason == "abort"


def test_abort_mid_decode_frees_blocks(make_engine):
    eng = make_engine()
    eng.add_request(
        "a", list(range(3, 30)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_used_blocks > 0
    eng.abort("a")
    assert eng.blocks.num_used_blocks == 0
    assert eng.step()[0].finished


def test_missing_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf")


def test_corrupt_and_truncated_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        load_model(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(junk)


@pytest.mark.slow
def test_truncated_default_gguf(tmp_path):
    from services.engine.loader import default_model_path

    src = default_model_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        load_model(cut)


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama-gqa-tied"), folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_model(folder)


def _copy_with_config(src, folder, **changes):
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    folder = _copy_with_config(
        tiny_model_dir("llama-gqa-tied"), tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_model(folder)


def test_unsupported_rope_type_is_named(tiny_model_dir, tmp_path):
    folder = _copy_with_config(
        tiny_model_dir("llama-gqa-tied"),
        tmp_path / "yarn",
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    with pytest.raises(ModelLoadError, match="'yarn'"):
        load_model(folder)


def test_sharded_safetensors_folder(tiny_model_dir, tmp_path, make_engine):
    from safetensors.torch import load_file, save_file

    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    src = tiny_model_dir("llama-mha-untied")
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    save_file(
        {n: sd[n] for n in names[: len(names) // 2]},
        str(folder / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {n: sd[n] for n in names[len(names) // 2 :]},
        str(folder / "model-00002-of-00002.safetensors"),
    )
    ref = make_engine("llama-mha-untied").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0)
    )
    eng = Engine(
        load_model(folder), None, EngineConfig(num_kv_blocks=64, block_size=4, dtype="float32")
    )
    assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0)) == ref


def test_caps_and_the_smallest_temperature_are_accepted():
    from services.engine.sampling_params import MAX_STOP, MAX_STOP_CHARS, MIN_TEMPERATURE

    SamplingParams.create(temperature=MIN_TEMPERATURE, stop=["z" * MAX_STOP_CHARS] * MAX_STOP)


def test_a_sampling_failure_fails_its_request_alone(make_engine, monkeypatch):
    """Regression: a NaN distribution made torch.multinomial raise for the whole step, and
    every request in the batch was aborted. Now the failing request ends with ERROR and the
    others in its steps go on, with the tokens they would have had."""
    from services.engine import sampler
    from services.engine.request import FinishReason

    real = sampler._sample_row

    def fragile(logits, p, seed):  # type: ignore[no-untyped-def]
        if p.top_k == 7:  # the marked request: its probabilities are NaN
            return real(logits * float("nan"), p, seed)
        return real(logits, p, seed)

    monkeypatch.setattr(sampler, "_sample_row", fragile)
    eng = make_engine()
    alone = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.add_request("bad", [9, 10, 11], SamplingParams(max_tokens=6, temperature=1.0, top_k=7))
    eng.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs: dict[str, list] = {"bad": [], "ok": []}
    while eng.has_unfinished:
        for o in eng.step():
            outs[o.request_id].append(o)
    (bad,) = outs["bad"]
    assert bad.finished and bad.finish_reason is FinishReason.ERROR
    assert bad.error and "sampling failed" in bad.error and not bad.new_token_ids
    assert [t for o in outs["ok"] for t in o.new_token_ids] == alone[0]
    assert outs["ok"][-1].finish_reason is FinishReason.LENGTH
    assert eng.blocks.num_used_blocks == 0


def test_max_model_len_is_capped_by_the_kv_cache_and_an_explicit_one_must_fit(make_engine):
    eng = make_engine(num_kv_blocks=32)  # 32 x 4 = 128 tokens; the model's context is 512
    assert eng.max_model_len == 128
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("long", [1, 2], SamplingParams(max_tokens=127))  # 129 tokens
    assert e.value.field == "max_tokens"
    assert make_engine(num_kv_blocks=32, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len 200 does not fit this replica's KV"):
        make_engine(num_kv_blocks=32, max_model_len=200)
