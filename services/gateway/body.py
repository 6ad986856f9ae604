"""Decoding a request body at the edge, before any model work: bounded in size before it is
read, strict JSON (finite numbers only), bounded nesting, valid Unicode. Pure: no I/O.

Every refusal is an ``InvalidRequestError`` naming the field (HTTP 400), except a body over the
size cap: ``PayloadTooLargeError`` (HTTP 413), raised before the body is read or parsed.
Why each check: Python's ``json`` accepts NaN / Infinity and lone UTF-16 surrogates
(``"\\ud800"``), which later fail deep in sampling or tokenization as server errors, and
recurses once per nesting level (a 5,000-deep body raised RecursionError: a 500).
"""

from __future__ import annotations

import json
import math

from services.engine.errors import InvalidRequestError

MAX_DEPTH = 32  # nesting levels; real request bodies use at most 4


class PayloadTooLargeError(InvalidRequestError):
    """The body is over ``max_request_bytes`` (HTTP 413)."""

    def __init__(self, size: int | None, limit: int) -> None:
        what = "the body" if size is None else f"the body ({size} bytes)"
        super().__init__("body", f"{what} is over the {limit}-byte limit (max_request_bytes)")


class _NonFinite:
    """What ``json`` makes of NaN / Infinity / -Infinity here: refused with its field."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def check_size(declared: int | None, limit: int) -> None:
    """Refuse by the Content-Length header, before reading a byte."""
    if declared is not None and declared > limit:
        raise PayloadTooLargeError(declared, limit)


def decode(raw: bytes) -> object:
    """Strict JSON of ``raw``; raises InvalidRequestError naming the first bad field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError("body", f"not UTF-8: {e}") from None
    try:
        obj = json.loads(text, parse_constant=_NonFinite)
    except RecursionError:
        raise InvalidRequestError("body", f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, and integers longer than Python converts
        raise InvalidRequestError("body", f"malformed JSON: {e}") from None
    check_tree(obj)
    return obj


def check_tree(obj: object) -> None:
    """Walk the decoded body (iteratively): depth, finite numbers, encodable strings."""
    stack: list[tuple[object, str, int]] = [(obj, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequestError(path or "body", f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, _NonFinite) or (isinstance(node, float) and not math.isfinite(node)):
            literal = node.literal if isinstance(node, _NonFinite) else repr(node)
            raise InvalidRequestError(path or "body", f"must be a finite number, got {literal}")
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, path or "body")
                stack.append((value, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(node, list):
            stack.extend(
                (v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(node)
            )


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            path or "body", f"contains an unpaired UTF-16 surrogate at character {e.start}"
        ) from None
