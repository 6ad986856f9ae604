"""The Redis index over TLS (``rediss://``) with a password, against a real TLS redis-server."""

from __future__ import annotations

import uuid

import pytest
import redis

from services.engine.block_hash import hash_blocks
from services.prefix_index.redis_index import RedisIndex
from tests.fixtures import free_port, make_tls_certs, start_redis

H = hash_blocks(list(range(32)), 8)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    files = make_tls_certs(tmp_path_factory.mktemp("tls"))
    port = free_port()
    proc = start_redis(port, "tls-pw", tls=files)
    yield port, files[2]
    proc.terminate()
    proc.wait(timeout=10)


def test_lookups_over_tls_with_a_password(tls_redis):
    port, ca = tls_redis
    index = RedisIndex(
        f"rediss://127.0.0.1:{port}/0",
        f"tls-{uuid.uuid4().hex[:6]}",
        password="tls-pw",
        ca_cert=str(ca),
    )
    index.heartbeat("a", 30)
    index.add("a", H[:3])
    assert index.lookup(H) == {"a": 3}


def test_tls_server_refuses_plain_text_and_unverified_certificates(tls_redis):
    port, _ = tls_redis
    with pytest.raises(redis.ConnectionError):  # plain text to a TLS port
        RedisIndex(f"redis://127.0.0.1:{port}/0", password="tls-pw").lookup(H)
    with pytest.raises(redis.ConnectionError):  # a server certificate nobody vouched for
        RedisIndex(f"rediss://127.0.0.1:{port}/0", password="tls-pw").lookup(H)
