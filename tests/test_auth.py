"""Bearer keys and tenants: which tenant a key belongs to, refusals, and the prefix-cache scope
each tenant gets (its own, whatever cache_salt it sends)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from services.config import load_config
from services.engine.block_hash import hash_blocks, salted_root
from services.gateway.auth import DEFAULT_TENANT, TokenCheck, tenant_salt


def test_no_keys_allow_everyone_in_the_shared_scope():
    check = TokenCheck(None)
    assert not check.enabled and check.tenant(None) == "" and check.ok("Bearer anything")
    assert tenant_salt("", None) is None and tenant_salt("", "s") == "s"


def test_each_key_names_its_tenant_and_anything_else_is_refused():
    check = TokenCheck(SecretStr("single"), {"a": SecretStr("key-a"), "b": SecretStr("key-b")})
    assert check.enabled
    assert check.tenant("Bearer key-a") == "a" and check.tenant("Bearer key-b") == "b"
    assert check.tenant("Bearer single") == DEFAULT_TENANT
    for bad in (None, "", "key-a", "Bearer key-", "Bearer key-ab", "bearer key-a"):
        assert check.tenant(bad) is None and not check.ok(bad)
    assert not TokenCheck(SecretStr("")).enabled  # an empty token is no auth, never "Bearer "


def test_a_tenant_cannot_reach_another_s_scope_with_any_salt():
    a = tenant_salt("a", None)
    assert a != tenant_salt("b", None) and a != tenant_salt("a", "x")
    # tenant b sending tenant a's derived salt, or a's own salt text, still lands in b's scope
    assert tenant_salt("b", a) not in (a, tenant_salt("a", a))
    prompt = list(range(40))
    assert hash_blocks(prompt, 4, salted_root(a)) != hash_blocks(
        prompt, 4, salted_root(tenant_salt("b", None))
    )


def test_api_keys_load_from_json_in_the_environment():
    cfg = load_config(environ={"PDSERVE_API_KEYS": '{"a": "key-a", "b": "key-b"}'})
    assert {k: v.get_secret_value() for k, v in cfg.api_keys.items()} == {
        "a": "key-a",
        "b": "key-b",
    }
    assert "key-a" not in repr(cfg)
    for bad in ('{"a": "k", "b": "k"}', '{"a": ""}', "not json", '{"": "k"}'):
        with pytest.raises(ValueError, match="api_keys"):
            load_config(environ={"PDSERVE_API_KEYS": bad})
