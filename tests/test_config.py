"""Configuration: YAML < PDSERVE_* environment < flags; bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from services.config import ServeConfig, load_config
from services.engine.errors import InvalidRequestError
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, parse
from services.pd_flow import prefill_on_decode

REPO = Path(__file__).resolve().parents[1]


def test_example_yaml_loads_with_the_documented_defaults():
    cfg = load_config(REPO / "deploy/pdserve.yaml", environ={})
    assert cfg == load_config(environ={})  # the example file spells out the defaults
    assert cfg.http_port == 8000 and cfg.mode == "disaggregated"
    assert cfg.prefill.resource == "prefill_pool" and cfg.decode.resource == "decode_pool"
    spelled = yaml.safe_load((REPO / "deploy/pdserve.yaml").read_text())
    missing = set(ServeConfig.model_fields) - set(spelled)
    assert not missing, f"deploy/pdserve.yaml does not list {sorted(missing)}"


def test_precedence_yaml_env_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("mode: colocated\nhttp_port: 9000\ndecode:\n  replicas: 3\n  threads: 2\n")
    env = {"PDSERVE_HTTP_PORT": "9100", "PDSERVE_DECODE__REPLICAS": "4", "OTHER": "x"}
    cfg = load_config(f, {"decode": {"replicas": 5}}, environ=env)
    assert cfg.mode == "colocated"  # yaml
    assert cfg.http_port == 9100  # env beats yaml
    assert cfg.decode.replicas == 5 and cfg.decode.threads == 2  # flag beats env; yaml kept
    engine_cfg = cfg.engine_config(cfg.decode, "decode")
    assert engine_cfg.threads == 2 and engine_cfg.role == "decode"


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"http_port": 70000}, "http_port"),
        ({"prefill": {"replicas": 0}}, "replicas"),
        ({"decode": {"num_kv_blocks": "many"}}, "num_kv_blocks"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"grpc_tls_cert": "/c.pem"}, "grpc_tls_key"),  # a certificate without its key
        ({"max_inflight_requests": 0}, "max_inflight_requests"),
        ({"decode": {"max_queued_requests": -2}}, "max_queued_requests"),
    ],
)
def test_bad_config_names_the_field(over, field):
    with pytest.raises(ValidationError, match=field):
        load_config(overrides=over, environ={})


def test_auth_token_from_the_environment_is_secret_and_checked():
    from services.gateway.auth import TokenCheck

    cfg = load_config(environ={"PDSERVE_AUTH_TOKEN": "s3cr3t"})
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in str(cfg.model_dump())
    check = TokenCheck(cfg.auth_token)
    assert check.enabled and check.ok("Bearer s3cr3t")
    assert not any(
        map(check.ok, (None, "", "s3cr3t", "Bearer s3cr3t2", "Bearer s3cr3", "bearer s3cr3t"))
    )
    # unset or empty: no authentication at all (an empty token must not accept "Bearer ")
    for environ in ({}, {"PDSERVE_AUTH_TOKEN": ""}):
        check = TokenCheck(load_config(environ=environ).auth_token)
        assert not check.enabled and check.ok(None)


def test_admission_bounds_in_flight_requests_and_always_releases():
    from prometheus_client import CollectorRegistry

    from services.gateway.admission import Admission, OverloadedError

    adm = Admission(2, 0.5, CollectorRegistry())
    with adm.slot(), adm.slot():
        with pytest.raises(OverloadedError) as e, adm.slot():
            pass
        assert e.value.retry_after_s == 0.5 and adm.inflight == 2
    assert adm.inflight == 0
    with pytest.raises(RuntimeError), adm.slot():  # an error inside releases the slot too
        raise RuntimeError("boom")
    assert adm.inflight == 0


def test_serve_config_file_builds_the_app():
    import yaml

    from services.app import app_from_env

    spec = yaml.safe_load((REPO / "deploy/serve_config.yaml").read_text())["applications"][0]
    assert spec["import_path"] == "services.app:app_from_env"
    args = dict(spec["args"], config=str(REPO / spec["args"]["config"]))
    app = app_from_env(args)
    assert type(app).__name__ == "Application"


def test_pool_autoscaling_becomes_a_ray_serve_custom_policy():
    from ray.serve.config import AutoscalingConfig

    from services.app import _replicas
    from services.autoscale.policy import SloPolicy

    cfg = load_config(
        overrides={"prefill": {"replicas": 5, "autoscaling": {"target_s": 0.8, "max_replicas": 3}}},
        environ={},
    )
    assert _replicas(cfg.decode, "itl") == {"num_replicas": 1}  # no block: a fixed count
    kw = _replicas(cfg.prefill, "ttft")["autoscaling_config"]
    ac = AutoscalingConfig(**kw)  # what Ray Serve accepts
    assert (ac.min_replicas, ac.max_replicas, ac.initial_replicas) == (1, 3, 3)
    assert ac.upscale_delay_s == 0 and ac.downscale_delay_s == 0  # the planner owns delays
    assert kw["policy"]["policy_function"] == "services.autoscale.policy:SloPolicy"
    policy = SloPolicy(**kw["policy"]["policy_kwargs"])  # the controller builds it so
    assert policy.target.metric == "ttft" and policy.target.target_s == 0.8


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": "lots"}, "max_tokens"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
        ([1, 2], "body"),
    ],
)
def test_openai_bodies_name_the_bad_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        parse(CompletionRequest, body)
    assert e.value.field == field


def test_chat_body_translates_to_sampling_params():
    req = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "stop": "END",
            "seed": 3,
            "logprobs": True,
        },
    )
    p = req.sampling_params(100, req.logprobs)
    assert (p.greedy, p.stop, p.seed, p.max_tokens, p.logprobs) == (True, ("END",), 3, 100, True)
    for n in (0, 17):
        with pytest.raises(InvalidRequestError) as e:
            parse(CompletionRequest, {"model": "m", "prompt": "x", "n": n})
        assert e.value.field == "n"
    batch = parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "n": 2})
    assert batch.prompts() == ["a", "b"]
    assert parse(CompletionRequest, {"model": "m", "prompt": [5, 6]}).prompts() == [[5, 6]]
    with pytest.raises(InvalidRequestError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": ["a"] * 9, "n": 8}).prompts()
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        parse(ChatCompletionRequest, {"model": "m", "messages": []})
    assert e.value.field == "messages"


def test_min_tokens_and_logit_bias_reach_the_sampling_params():
    body = {"model": "m", "prompt": "x", "min_tokens": 3, "logit_bias": {"50": -100, "7": 5}}
    p = parse(CompletionRequest, body).params(10)
    assert p.min_tokens == 3 and p.logit_bias == ((7, 5.0), (50, -100.0))
    with pytest.raises(InvalidRequestError) as e:
        parse(CompletionRequest, {**body, "logit_bias": {"abc": 1}}).params(10)
    assert e.value.field == "logit_bias"


def test_penalties_reach_the_sampling_params_and_bad_ones_are_refused_by_name():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    pen = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.1}
    p = parse(ChatCompletionRequest, {**body, **pen}).params(10)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.1)
    for field, bad in (("presence_penalty", 3), ("repetition_penalty", -1)):
        with pytest.raises(InvalidRequestError) as e:
            parse(ChatCompletionRequest, {**body, field: bad}).params(10)
        assert e.value.field == field


def test_conditional_disaggregation_rule():
    assert prefill_on_decode("colocated", 1000, 0, 0)
    assert not prefill_on_decode("disaggregated", 5, 0, 0)  # threshold 0: never
    assert prefill_on_decode("disaggregated", 5, 0, 12)
    assert not prefill_on_decode("disaggregated", 40, 0, 12)
    assert prefill_on_decode("disaggregated", 40, 32, 12)  # only 8 tokens left uncached


def test_engine_replicas_are_bound_without_the_api_token():
    """Only the gateway checks the token: the engine replicas' arguments (pickled into Ray's
    state with every replica) do not carry it."""
    from services.app import build_app

    cfg = load_config(overrides={"auth_token": "tok-123", "routing": "least_loaded"}, environ={})
    gateway = build_app(cfg)._bound_deployment
    prefill, decode, gw_cfg = gateway.init_args[:3]
    assert gw_cfg.auth_token.get_secret_value() == "tok-123"
    for pool in (prefill, decode):
        (pool_cfg, *_) = pool._bound_deployment.init_args
        assert pool_cfg.auth_token is None and pool_cfg.model == cfg.model


def test_the_gateway_reads_api_keys_from_its_environment_when_it_can(monkeypatch):
    """Keys given through the environment (the chart, a local serve) stay out of the gateway's
    bound arguments (Ray's state): the gateway's process reads them from the environment it
    inherits. Keys given any other way are bound as before."""
    from services.app import build_app
    from services.config import secrets_from, secrets_in_env

    env = {"PDSERVE_AUTH_TOKEN": "tok-123", "PDSERVE_API_KEYS": '{"b": "key-b"}'}
    monkeypatch.setattr("os.environ", {**env})
    cfg = load_config(overrides={"routing": "least_loaded"})
    assert secrets_in_env(cfg, env)
    gateway = build_app(cfg)._bound_deployment
    gw_cfg, from_env = gateway.init_args[2], gateway.init_args[4]
    assert from_env and gw_cfg.auth_token is None and gw_cfg.api_keys == {}
    got = secrets_from(env)
    assert got["auth_token"].get_secret_value() == "tok-123"
    assert got["api_keys"]["b"].get_secret_value() == "key-b"
    # a token from the config file or flags (not in the environment) is bound as before
    monkeypatch.setattr("os.environ", {})
    flagged = load_config(overrides={"auth_token": "tok-9", "routing": "least_loaded"}, environ={})
    assert not secrets_in_env(flagged, {})
    bound = build_app(flagged)._bound_deployment.init_args
    assert bound[2].auth_token.get_secret_value() == "tok-9" and bound[4] is False
