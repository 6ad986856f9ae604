"""Bearer-token check shared by the HTTP and gRPC APIs (one setting: ``auth_token``)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr


class TokenCheck:
    """``ok(authorization)`` for the value of an ``Authorization`` header / ``authorization``
    metadata entry. With no token configured every caller is allowed."""

    def __init__(self, token: SecretStr | None) -> None:
        value = token.get_secret_value() if token is not None else ""
        # NOTE: an empty token (PDSERVE_AUTH_TOKEN="") means no auth, never "accept 'Bearer '"
        self._want = f"Bearer {value}".encode() if value else None

    @property
    def enabled(self) -> bool:
        return self._want is not None

    def ok(self, authorization: str | None) -> bool:
        if self._want is None:
            return True
        # NOTE: constant-time, so response timing does not leak how much of a guess matched
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._want)
