"""Request bodies at the edge (services.gateway.body): bounded before reading, strict JSON,
bounded nesting, valid Unicode; each refusal names its field."""

from __future__ import annotations

import pytest

from services.engine.errors import InvalidRequestError
from services.gateway.body import MAX_DEPTH, PayloadTooLargeError, check_size, decode


def test_a_good_body_decodes():
    assert decode(b'{"prompt": "h\\u00e9", "temperature": 0.5, "stop": ["a"]}') == {
        "prompt": "hé",
        "temperature": 0.5,
        "stop": ["a"],
    }


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        (b'{"prompt": "a\\ud800b"}', "prompt", "unpaired UTF-16 surrogate"),
        (
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
            "surrogate",
        ),
        (b'{"\\ud800": 1}', "body", "surrogate"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature", "finite number, got NaN"),
        (b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "-Infinity"),
        (b'{"prompt": "hi", "temperature": 1e400}', "temperature", "finite number"),
        (b'{"prompt": [1, ' + b"9" * 5000 + b"]}", "body", "malformed JSON"),
        (b"\xff\xfe{}", "body", "not UTF-8"),
        (b"[" * 5000 + b"]" * 5000, "body", "nested deeper"),
        (b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "a", "nested deeper"),
        (b"{not json", "body", "malformed JSON"),
    ],
)
def test_bad_bodies_are_refused_by_field(raw, field, words):
    with pytest.raises(InvalidRequestError) as e:
        decode(raw)
    assert e.value.field.startswith(field) and words in str(e.value), str(e.value)
    assert not isinstance(e.value, PayloadTooLargeError)


def test_size_is_checked_before_reading():
    check_size(None, 100)  # chunked: counted while reading instead
    check_size(100, 100)
    with pytest.raises(PayloadTooLargeError, match=r"4000000 bytes.*100-byte limit"):
        check_size(4_000_000, 100)
