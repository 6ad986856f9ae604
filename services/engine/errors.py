"""Typed engine errors. The serving edge maps each to one HTTP / gRPC status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request argument is out of range or malformed (HTTP 400 / INVALID_ARGUMENT).

    Attributes:
        field: name of the offending request field, as the client spelled it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(EngineError):
    """The model path is missing, unreadable, truncated or corrupt."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not a Llama-family decoder this engine runs."""

    def __init__(self, architecture: str, supported: list[str]) -> None:
        super().__init__(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(supported))}"
        )
        self.architecture = architecture


class LayoutMismatchError(EngineError):
    """A KV handle's layout fingerprint differs from the receiving engine's own."""


class UnknownRequestError(EngineError, KeyError):
    """An operation named a request id the engine does not hold (HTTP 404 / NOT_FOUND)."""


class RequestFailedError(EngineError):
    """One request failed inside the engine (its sampling raised); the rest of its batch went
    on. Never retried: the same inputs fail the same way."""
