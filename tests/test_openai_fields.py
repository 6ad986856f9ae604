"""No silent ignore: every request field is implemented, refused by name as not implemented
(the documented ``UNSUPPORTED`` list), or refused as unknown."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.errors import InvalidRequestError
from services.gateway.openai_models import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
README = Path(__file__).resolve().parents[1] / "README.md"


def _refused(model, body) -> InvalidRequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as e:
        parse(model, body)
    return e.value


@pytest.mark.parametrize("field", sorted(UNSUPPORTED["sampling"]))
def test_an_unimplemented_field_is_refused_by_name_unless_neutral(field):
    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        err = _refused(model, {**base, field: {"type": "json_object"}})
        assert err.field == field and "not implemented" in err.message
        for neutral in (None, False, 0, "", [], {}):
            parse(model, {**base, field: neutral})  # asks for nothing: accepted


def test_echo_is_a_completions_field_and_not_a_chat_one():
    req = parse(CompletionRequest, {**COMPLETION, "echo": True, "logprobs": 2})
    assert req.params(4).prompt_logprobs == 2
    assert parse(CompletionRequest, {**COMPLETION, "echo": True}).params(4).prompt_logprobs is None
    assert parse(CompletionRequest, {**COMPLETION, "logprobs": 1}).params(4).prompt_logprobs is None
    err = _refused(ChatCompletionRequest, {**CHAT, "echo": True})
    assert err.field == "echo" and "not implemented" in err.message
    parse(ChatCompletionRequest, {**CHAT, "echo": False})  # neutral: accepted


def test_an_unknown_field_is_refused_as_unknown():
    err = _refused(ChatCompletionRequest, {**CHAT, "temprature": 0.5})
    assert (err.field, err.message) == ("temprature", "unknown field")
    err = _refused(CompletionRequest, {**COMPLETION, "max_token": 5})
    assert err.field == "max_token"


def test_message_fields_are_checked_too():
    msg = {"role": "user", "content": "hi", "name": "ann"}
    err = _refused(ChatCompletionRequest, {**CHAT, "messages": [msg]})
    assert err.field == "messages.0.name" and "not implemented" in err.message
    msg = {"role": "user", "content": "hi", "colour": "red"}
    assert _refused(ChatCompletionRequest, {**CHAT, "messages": [msg]}).field == (
        "messages.0.colour"
    )
    ok = {"role": "user", "content": "hi", "tool_calls": [], "name": None}
    parse(ChatCompletionRequest, {**CHAT, "messages": [ok]})


def test_content_parts_of_text_are_joined_and_other_parts_refused_by_name():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    req = parse(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[0].model_dump() == {"role": "user", "content": "Hello, world"}
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [parts[0], image]}]}
    assert _refused(ChatCompletionRequest, body).field.startswith("messages.0.content.1")


def test_the_readme_lists_every_unimplemented_field():
    text = README.read_text()
    missing = [f for kind in UNSUPPORTED.values() for f in kind if f"`{f}`" not in text]
    assert not missing, f"README does not list {missing}"
