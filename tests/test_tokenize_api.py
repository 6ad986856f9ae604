"""``POST /tokenize`` and ``/detokenize`` (vLLM's shapes) on the gateway's HTTP app, over the
default model's real tokenizer; no engine is involved."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.config import ServeConfig
from services.gateway.gateway import Gateway
from services.gateway.http_api import build_http_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    cfg = ServeConfig(mode="colocated", routing="least_loaded", grpc_port=0)
    gw = Gateway(None, None, cfg)  # type: ignore[arg-type]
    return TestClient(build_http_app(gw))


def test_tokenize_a_prompt_and_back(client):
    r = client.post("/tokenize", json={"prompt": "Hello, world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 1 and body["max_model_len"] == 8192
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello, world"
    back = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello, world"}


def test_tokenize_messages_as_the_chat_endpoint_renders_them(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    body = client.post("/tokenize", json={"messages": msgs}).json()
    text = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.rstrip().endswith("assistant") and "Hi" in text  # with the generation prompt
    assert body["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": "a", "chat_template": "{{x}}"}, "chat_template"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "colour": 1}, "colour"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_field(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_another_model_is_a_404(client):
    assert client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}).status_code == 404
