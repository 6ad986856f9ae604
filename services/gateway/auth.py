"""Bearer-key check shared by the HTTP and gRPC APIs: ``auth_token`` (one key, tenant
``default``) and ``api_keys`` (tenant name -> key). The tenant a key belongs to scopes its
prefix cache (``tenant_salt``)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from pydantic import SecretStr

DEFAULT_TENANT = "default"


class TokenCheck:
    """``tenant(authorization)`` / ``ok(authorization)`` for the value of an ``Authorization``
    header / ``authorization`` metadata entry. With no key configured every caller is allowed
    (tenant ``""``: the shared cache)."""

    def __init__(
        self, token: SecretStr | None, api_keys: Mapping[str, SecretStr] | None = None
    ) -> None:
        keys = dict(api_keys or {})
        value = token.get_secret_value() if token is not None else ""
        # NOTE: an empty token (PDSERVE_AUTH_TOKEN="") means no auth, never "accept 'Bearer '"
        if value:
            keys.setdefault(DEFAULT_TENANT, token)  # type: ignore[arg-type]
        self._want = [
            (name, f"Bearer {k.get_secret_value()}".encode())
            for name, k in keys.items()
            if k.get_secret_value()
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._want)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant whose key this is; ``""`` when no key is configured; None: refused."""
        if not self._want:
            return ""
        got = (authorization or "").encode()
        found = None
        # NOTE: every key compared in constant time, without stopping at a match, so response
        # timing leaks neither how much of a guess matched nor which key it was close to
        for name, want in self._want:
            if hmac.compare_digest(got, want) and found is None:
                found = name
        return found

    def ok(self, authorization: str | None) -> bool:
        return self.tenant(authorization) is not None


def tenant_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The prefix-cache scope of a request: the tenant's own (so one tenant can neither reuse
    nor probe another's cached prefixes, whatever ``cache_salt`` it sends), and within it the
    client's ``cache_salt``. No tenant (no keys configured): the client's salt as sent."""
    if not tenant:
        return cache_salt
    return hashlib.sha256(f"{tenant}\0{cache_salt or ''}".encode()).hexdigest()
