"""The KV transport registry (the protocols and errors live in ``kvtransfer.base``).

A prefill replica runs a transport *server* over its ``kvtransfer.outbox.Outbox``; a decode
replica's ``kvtransfer.inbox.Inbox`` *pulls* a request's blocks with the transport client (a
whole pull, or a layer-wise stream it attaches to while the prefill runs) and then releases
them.
NOTE: pull, not push: the decode replica knows when it has room for the blocks, so it pulls
when it can place them, and the prefill side never buffers for a receiver that is not ready.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtransfer.base import KVTls, Transport


def _load_grpc(tls: KVTls | None) -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport(tls=tls)


def _load_shm(tls: KVTls | None) -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport(shared_memory=True, tls=tls)


def _no_tls(name: str, tls: KVTls | None) -> None:
    if tls is not None:
        raise ValueError(
            f"KV transport {name} has no TLS (torch.distributed's store and groups are "
            "plaintext); use kv_transport grpc or shm with the kv_tls_* settings"
        )


def _load_gloo(tls: KVTls | None) -> Transport:
    _no_tls("gloo", tls)
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("gloo")


def _load_nccl(tls: KVTls | None) -> Transport:
    _no_tls("nccl", tls)
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("nccl")


# NOTE: lazy: a transport's dependencies load only when it is chosen
TRANSPORTS: dict[str, Callable[[KVTls | None], Transport]] = {
    "grpc": _load_grpc,
    "shm": _load_shm,
    "gloo": _load_gloo,
    "nccl": _load_nccl,
}


def get_transport(name: str, tls: KVTls | None = None) -> Transport:
    """Instantiate a transport by name (``tls``: mutual TLS, grpc and shm only); the error
    lists the valid names."""
    try:
        load = TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of: {', '.join(TRANSPORTS)}"
        ) from None
    return load(tls)
