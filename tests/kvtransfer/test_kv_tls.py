"""Mutual TLS on the KV plane (grpc, shm): a peer with a certificate signed by the CA pulls and
streams as before; a plaintext peer, or one without a client certificate, gets nothing; the
torch.distributed transports, which have no TLS, are refused by name."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvtransfer.base import KVTls, TransferError
from kvtransfer.transport import get_transport
from services.config import load_config
from tests.fixtures import make_tls_certs
from tests.kvtransfer.kv_fixtures import DictSource, random_handle


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    cert, key, ca = make_tls_certs(tmp_path_factory.mktemp("kv-tls"))
    return KVTls(cert.read_bytes(), key.read_bytes(), ca.read_bytes())


@pytest.mark.parametrize("name", ["grpc", "shm"])
def test_only_a_peer_with_a_ca_signed_certificate_gets_the_kv(tls, name):
    h = random_handle()
    server = get_transport(name, tls).serve(DictSource({"r": h}), "127.0.0.1", 0)
    try:
        good = get_transport(name, tls).client()
        got = good.pull(server.address, "r", h.fingerprint, 10)
        assert torch.equal(got.blocks, h.blocks)
        good.close()
        plain = get_transport(name).client()
        with pytest.raises(TransferError):
            plain.pull(server.address, "r", h.fingerprint, 5)
        plain.close()
        no_cert = get_transport(name, dataclasses.replace(tls, cert=b"", key=b"")).client()
        with pytest.raises(TransferError):
            no_cert.pull(server.address, "r", h.fingerprint, 5)
        no_cert.close()
    finally:
        server.stop()


def test_a_layer_wise_stream_over_tls(tls):
    from tests.kvtransfer.kv_fixtures import feed

    h = random_handle()
    src = DictSource({"r": h})
    server = get_transport("grpc", tls).serve(src, "127.0.0.1", 0)
    client = get_transport("grpc", tls).client()
    try:
        stream = src.open_stream(h)
        box: dict = {}
        th = threading.Thread(
            target=lambda: box.update(r=client.pull_stream(server.address, "r", h.fingerprint, 20))
        )
        th.start()
        feed(stream, h).join()
        th.join(30)
        got, _ = box["r"]
        n = h.num_computed
        assert torch.equal(got.blocks.flatten(2, 3)[:, :, :n], h.blocks.flatten(2, 3)[:, :, :n])
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("name", ["gloo", "nccl"])
def test_transports_without_tls_are_refused_by_name(tls, name):
    with pytest.raises(ValueError, match=f"{name} has no TLS"):
        get_transport(name, tls)
    with pytest.raises(ValueError, match="kv_tls"):
        load_config(
            overrides={
                "kv_transport": name,
                "kv_tls_cert": "c",
                "kv_tls_key": "k",
                "kv_tls_ca": "a",
            },
            environ={},
        )
    with pytest.raises(ValueError, match="together"):
        load_config(overrides={"kv_tls_cert": "c"}, environ={})
