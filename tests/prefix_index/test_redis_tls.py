"""The Redis index over TLS (``rediss://``) with a password, against a real TLS redis-server."""

from __future__ import annotations

import datetime
import ipaddress
import uuid

import pytest
import redis

from services.engine.block_hash import hash_blocks
from services.prefix_index.redis_index import RedisIndex
from tests.fixtures import free_port, start_redis

H = hash_blocks(list(range(32)), 8)


def _certs(tmp):  # a CA and a server certificate for 127.0.0.1, signed by it
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, key, issuer, issuer_key, ca):  # type: ignore[no-untyped-def]
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("pdserve test CA", ca_key, "pdserve test CA", ca_key, True)
    server = cert("127.0.0.1", key, "pdserve test CA", ca_key, False)
    paths = tmp / "server.crt", tmp / "server.key", tmp / "ca.crt"
    paths[0].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    files = _certs(tmp_path_factory.mktemp("tls"))
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
