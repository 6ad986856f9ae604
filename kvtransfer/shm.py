"""Same-host handover of KV payloads through POSIX shared memory (files in /dev/shm).

The sender names one of its segments in the transfer's header, then copies the payload into
it chunk by chunk, announcing each chunk (its checksum) as a gRPC message once it is in; the
receiver copies each announced chunk out through a mapping it keeps, while the sender writes
the next, and checks its checksum *on its copy*. The segment stays the sender's: it is the
request's until release (or the hold lease's expiry), then it carries later pulls.

NOTE: reused, not fresh per pull: writing a fresh tmpfs segment faults in and zeroes every
page (no huge pages on tmpfs): 700-1,250 ms of sender CPU per GB here, more than all of
gRPC's. Invariant: a receiver never returns bytes it did not check after copying them, so a
segment reused under a receiver that outlived its lease fails that receiver's checksums; it
never hands over the new occupant's KV.

``host_id`` tells whether two processes can share a segment: the kernel's boot id plus the
identity of their /dev/shm mount (containers on one node each have their own).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from services.engine.host_buffers import FreeList, aligned

SHM_DIR = Path("/dev/shm")


def host_id() -> str:
    """Equal for two processes exactly when they see the same /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""  # no /dev/shm: never same-host
    return f"{boot}:{st.st_dev}:{st.st_ino}"


PREFIX = "pdserve-kv-"


class _Segment:
    """One segment, mapped once for its life in this process."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        path = SHM_DIR / name
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"segment {name} holds fewer than {size} bytes")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.data = torch.frombuffer(self.map, dtype=torch.uint8)


def _check_name(name: str) -> None:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a KV segment name: {name!r}")


class SegmentReader:
    """The receiver's mappings of senders' segments, kept (a sender reuses its segments, so
    the next pull usually names a mapped one: no page-table faults again); at most
    ``max_maps`` and ``max_bytes`` of them, least recently used dropped (a mapping keeps a
    segment's memory even after its sender unlinked it)."""

    def __init__(self, max_maps: int = 16, max_bytes: int = 512 << 20) -> None:
        self.max_maps, self.max_bytes = max_maps, max_bytes
        self._maps: OrderedDict[str, _Segment] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, name: str, size: int) -> torch.Tensor:
        """The first ``size`` bytes of segment ``name`` as a mapped 1-D uint8 tensor (the
        sender's memory: copy out of it, and check the copy). Raises ValueError/OSError for
        a bad name or a missing or short segment."""
        _check_name(name)
        if not size:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            seg = self._maps.pop(name, None)
        if seg is None or seg.size < size:
            # NOTE: the whole file: the sender's segment may be larger than this payload
            seg = _Segment(name, os.stat(SHM_DIR / name).st_size, create=False)
            if seg.size < size:
                raise ValueError(f"segment {name} holds fewer than {size} bytes")
        with self._lock:
            self._maps[name] = seg
            while len(self._maps) > self.max_maps or (
                len(self._maps) > 1 and sum(g.size for g in self._maps.values()) > self.max_bytes
            ):
                self._maps.popitem(last=False)
        return seg.data[:size]

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def sweep_orphans() -> int:
    """Unlink segments whose sender process is gone (it died between writing a segment and
    handing it over); returns how many. NOTE: the creator's pid is part of every name."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        except PermissionError:
            pass  # alive, another user's
    return removed


class Segments:
    """The sender's segments: a pull's payload goes into a kept free segment (``FreeList``:
    best fit) or a new one of whole 2 MiB units. The segment is leased to the request until
    its release, or until ``lease_s`` passes without one; then it is kept for the next pull.
    A request pulled twice holds both leases (a pull still writing never shares its
    segment). Kept segments beyond ``max_free_bytes`` are unlinked, oldest first, and all at
    ``close``. A new sender first sweeps the orphans of dead ones."""

    def __init__(self, lease_s: float, max_free_bytes: int = 512 << 20) -> None:
        self.lease_s = lease_s
        sweep_orphans()
        self._free: FreeList[_Segment] = FreeList(lambda g: g.size, max_free_bytes)
        self._leases: dict[str, list[tuple[_Segment, float]]] = {}  # by request id
        self._lock = threading.Lock()
        self.expired = 0  # leases that ran out (the receiver never released)
        self.created = 0

    def reserve(self, request_id: str, nbytes: int) -> tuple[str, torch.Tensor]:
        """A segment of at least ``nbytes``, now leased to ``request_id``: its name and its
        first ``nbytes`` as a 1-D uint8 tensor for the caller to fill."""
        self.expire()
        n = max(1, nbytes)
        with self._lock:
            seg = self._free.take(n)
        if seg is None:
            seg = _Segment(f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}", aligned(n), True)
            self.created += 1
        with self._lock:
            self._leases.setdefault(request_id, []).append((seg, time.monotonic()))
        return seg.name, seg.data[:nbytes]

    def release(self, request_id: str) -> None:
        with self._lock:
            leases = self._leases.pop(request_id, [])
        self._keep([seg for seg, _ in leases])

    def expire(self) -> None:
        now = time.monotonic()
        segs = []
        with self._lock:
            for rid in list(self._leases):
                keep = [(g, t) for g, t in self._leases[rid] if now - t <= self.lease_s]
                segs += [g for g, t in self._leases[rid] if now - t > self.lease_s]
                if keep:
                    self._leases[rid] = keep
                else:
                    del self._leases[rid]
            self.expired += len(segs)
        self._keep(segs)

    def _keep(self, segs: list[_Segment]) -> None:
        with self._lock:
            drop = self._free.put(segs)
        for g in drop:
            _unlink(g.name)

    def _leased(self) -> list[_Segment]:
        return [g for leases in self._leases.values() for g, _ in leases]

    @property
    def names(self) -> set[str]:
        """Every segment this sender holds, leased or free."""
        with self._lock:
            return {g.name for g in self._free.items + self._leased()}

    def close(self) -> None:
        with self._lock:
            segs = self._free.drain() + self._leased()
            self._leases = {}
        for g in segs:
            _unlink(g.name)


def _unlink(name: str) -> bool:
    try:
        (SHM_DIR / name).unlink()
        return True
    except FileNotFoundError:
        return False
