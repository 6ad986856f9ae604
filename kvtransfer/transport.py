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

from kvtransfer.base import Transport


def _load_grpc() -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport()


def _load_shm() -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport(shared_memory=True)


def _load_gloo() -> Transport:
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("gloo")


def _load_nccl() -> Transport:
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("nccl")


# NOTE: lazy: a transport's dependencies load only when it is chosen
TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "grpc": _load_grpc,
    "shm": _load_shm,
    "gloo": _load_gloo,
    "nccl": _load_nccl,
}


def get_transport(name: str) -> Transport:
    """Instantiate a transport by name; the error lists the valid names."""
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of: {', '.join(TRANSPORTS)}"
        ) from None
