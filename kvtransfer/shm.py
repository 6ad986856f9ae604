"""Same-host handover of KV payloads through POSIX shared memory (files in /dev/shm).

The sender writes the payload into a fresh segment and names it in the transfer's header; the
receiver maps it, checks every chunk's checksum, and unlinks it (its mapping stays valid, so
the handle's tensor is the mapping itself: no second copy). The sender unlinks whatever is left
at release or when the hold lease expires (a receiver that died before unlinking).

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
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def host_id() -> str:
    """Equal for two processes exactly when they see the same /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""  # no /dev/shm: never same-host
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def write_segment(data: torch.Tensor) -> str:
    """Copy 1-D uint8 ``data`` (CPU) into a new segment; returns its name."""
    name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        size = data.numel()
        os.ftruncate(fd, max(1, size))
        with mmap.mmap(fd, max(1, size)) as m:
            if size:  # NOTE: the temporary view is gone before the mapping closes
                torch.frombuffer(m, dtype=torch.uint8, count=size).copy_(data)
    finally:
        os.close(fd)
    return name


def map_segment(name: str, size: int) -> torch.Tensor:
    """Map a segment read-only-by-convention as a 1-D uint8 tensor and unlink it."""
    if "/" in name or not name.startswith("pdserve-kv-"):
        raise ValueError(f"not a KV segment name: {name!r}")
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < max(1, size):
            raise ValueError(f"segment {name} holds fewer than {size} bytes")
        m = mmap.mmap(fd, max(1, size))
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return (
        torch.frombuffer(m, dtype=torch.uint8, count=size)
        if size
        else torch.empty(0, dtype=torch.uint8)
    )


def sweep_orphans() -> int:
    """Unlink segments whose sender process is gone (it died between writing a segment and
    handing it over); returns how many. NOTE: the creator's pid is part of every name."""
    removed = 0
    for path in SHM_DIR.glob("pdserve-kv-*"):
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
    """The sender's segments by request: unlinked at release, or after ``lease_s``. A new
    sender first sweeps the orphans of dead ones."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        sweep_orphans()
        self._by_request: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self.expired = 0  # leases that ran out (the receiver never took its segment)

    def add(self, request_id: str, name: str) -> None:
        with self._lock:
            old = self._by_request.pop(request_id, None)
            self._by_request[request_id] = (name, time.monotonic())
        if old is not None:
            _unlink(old[0])
        self.expire()

    def release(self, request_id: str) -> None:
        with self._lock:
            entry = self._by_request.pop(request_id, None)
        if entry is not None:
            _unlink(entry[0])

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [(r, n) for r, (n, t) in self._by_request.items() if now - t > self.lease_s]
            for r, _ in old:
                del self._by_request[r]
        for _, name in old:
            if _unlink(name):
                self.expired += 1

    def close(self) -> None:
        with self._lock:
            names = [n for n, _ in self._by_request.values()]
            self._by_request.clear()
        for name in names:
            _unlink(name)


def _unlink(name: str) -> bool:
    try:
        (SHM_DIR / name).unlink()
        return True
    except FileNotFoundError:
        return False  # the receiver took it
