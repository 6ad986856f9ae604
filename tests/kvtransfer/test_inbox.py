"""The Inbox (decode side of the KV handoff) without Ray or servers: pull versus stream by the
ref, a release after every receive, and one error type with a reason for every failure."""

from __future__ import annotations

import threading

import pytest

from kvtransfer.base import (
    KVRef,
    KVTransferFailedError,
    PermissionDeniedError,
    StreamFailedError,
    TransferError,
)
from kvtransfer.inbox import Inbox, InboxConfig, Receive
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from tests.fixtures import eventually
from tests.kvtransfer.kv_fixtures import random_handle


class Client:
    """A transport client that records calls and answers from a script."""

    def __init__(self, error: Exception | None = None, release_error: bool = False) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.secrets: list[str] = []
        self.error = error
        self.release_error = release_error
        self.handle = random_handle()

    def pull(self, address, request_id, layout, timeout_s, secret=""):
        self.calls.append(("pull", address, request_id))
        self.secrets.append(secret)
        assert timeout_s == 3.0
        if self.error is not None:
            raise self.error
        return self.handle

    def pull_stream(
        self, address, request_id, layout, timeout_s, stall_s=None, secret="", on_layers=None
    ):
        self.calls.append(("stream", address, request_id))
        self.secrets.append(secret)
        assert (timeout_s, stall_s) == (60.0, 9.0)
        if self.error is not None:
            raise self.error
        return self.handle, 1000.0

    def release(self, address, request_id, timeout_s, secret=""):
        self.calls.append(("release", address, request_id))
        self.secrets.append(secret)
        if self.release_error:
            raise TransferError("the sender went away")

    def close(self) -> None:
        pass


class Ticks:
    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


CFG = InboxConfig(pull_timeout_s=3.0, stream_timeout_s=60.0, stall_s=9.0)


def _inbox(client, clock=None, wall=None) -> Inbox:
    """Releases run synchronously here, so each test sees them at once."""
    return Inbox(
        client,
        client.handle.fingerprint,
        CFG,
        clock or Ticks(5.0, 5.25),
        wall or (lambda: 1000.5),
        release_in=lambda send: send(),
    )


def test_whole_pull_is_released_and_timed():
    client = Client()
    got = _inbox(client).receive(KVRef("r", "a:1", layerwise=False))
    assert got.handle is client.handle and got.nbytes == client.handle.nbytes
    assert got.exposed_s == pytest.approx(0.25)  # the pull's own time
    assert client.calls == [("pull", "a:1", "r"), ("release", "a:1", "r")]


def test_layerwise_ref_streams_and_exposes_only_the_excess():
    client = Client()
    inbox = _inbox(client)
    got = inbox.receive(KVRef("r", "a:1", layerwise=True))
    assert got.exposed_s == pytest.approx(0.5)  # finished at 1000.0 on the sender, got at 1000.5
    assert client.calls == [("stream", "a:1", "r"), ("release", "a:1", "r")]
    assert inbox.in_flight() == {}
    # a sender's clock ahead of ours exposes nothing, never a negative time
    early = _inbox(Client(), wall=lambda: 999.0).receive(KVRef("r", "a:1", layerwise=True))
    assert early.exposed_s == 0.0


@pytest.mark.parametrize(
    "error,reason",
    [
        (TimeoutError("late"), "deadline"),
        (UnknownRequestError("gone"), "not_held"),
        (LayoutMismatchError("head_dim"), "layout"),
        (TransferError("crc"), "transfer"),
        (StreamFailedError("aborted"), "transfer"),
        (PermissionDeniedError("wrong secret"), "denied"),
    ],
)
@pytest.mark.parametrize("layerwise", [False, True])
def test_failures_map_to_one_error_and_still_release(error, reason, layerwise):
    client = Client(error)
    inbox = _inbox(client)
    with pytest.raises(KVTransferFailedError) as e:
        inbox.receive(KVRef("r", "a:1", layerwise))
    assert e.value.reason == reason
    assert client.calls[-1] == ("release", "a:1", "r")
    assert inbox.failures == {reason: 1} and inbox.in_flight() == {}


def test_a_lost_release_does_not_fail_the_request():
    client = Client(release_error=True)
    got = _inbox(client).receive(KVRef("r", "a:1", layerwise=False))
    assert got.handle is client.handle


def test_unexpected_errors_are_not_mapped_but_still_release():
    client = Client(RuntimeError("a bug"))
    inbox = _inbox(client)
    with pytest.raises(RuntimeError, match="a bug"):
        inbox.receive(KVRef("r", "a:1", layerwise=False))
    assert client.calls[-1] == ("release", "a:1", "r") and inbox.in_flight() == {}


def test_injected_failure_and_duplicate_receive():
    client = Client()
    inbox = _inbox(client)
    inbox.fail_next = 1
    with pytest.raises(KVTransferFailedError, match="injected"):
        inbox.receive(KVRef("r", "a:1", layerwise=False))
    assert client.calls == [("release", "a:1", "r")]  # nothing pulled, still released
    inbox._receiving["busy"] = Receive.RECEIVING  # one under way
    with pytest.raises(ValueError, match="already"):
        inbox.receive(KVRef("busy", "a:1", layerwise=False))


def test_error_pickles_with_its_reason():
    import pickle

    e = pickle.loads(pickle.dumps(KVTransferFailedError("boom", "deadline")))
    assert (str(e), e.reason) == ("boom", "deadline")


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_ref_s_secret_goes_with_every_call(layerwise):
    client = Client()
    _inbox(client).receive(KVRef("r", "a:1", layerwise, "the-secret"))
    assert client.secrets == ["the-secret", "the-secret"]  # the transfer, then the release


class SlowReleaseClient(Client):
    """Its release waits until the test lets it through (a sender busy with its next chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.let_through = threading.Event()
        self.released = threading.Event()

    def release(self, address, request_id, timeout_s, secret=""):
        assert self.let_through.wait(10)
        super().release(address, request_id, timeout_s, secret)
        self.released.set()


@pytest.mark.parametrize("error", [None, TimeoutError("deadline")])
def test_receive_returns_without_waiting_for_the_release_and_still_sends_it(error):
    client = SlowReleaseClient()
    client.error = error
    inbox = Inbox(client, client.handle.fingerprint, CFG, Ticks(5.0, 5.25), lambda: 1000.5)
    if error is None:
        assert inbox.receive(KVRef("r", "a:1", layerwise=False)).handle is client.handle
    else:
        with pytest.raises(KVTransferFailedError):
            inbox.receive(KVRef("r", "a:1", layerwise=False))
    # returned while the release waits at the sender: it is still owed, and counted
    assert not client.released.is_set()
    assert inbox.in_flight() == {"r": "releasing"}
    client.let_through.set()
    assert client.released.wait(10)
    eventually(lambda: inbox.in_flight() == {}, 10, "the release to be counted as sent")
    assert client.calls[-1] == ("release", "a:1", "r")
    inbox.close()


def test_a_closed_inbox_sends_the_release_from_the_receiving_thread():
    client = Client()
    inbox = Inbox(client, client.handle.fingerprint, CFG, Ticks(5.0, 5.25), lambda: 1000.5)
    inbox.close()
    inbox.receive(KVRef("r", "a:1", layerwise=False))
    assert client.calls[-1] == ("release", "a:1", "r") and inbox.in_flight() == {}
