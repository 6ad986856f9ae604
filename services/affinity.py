"""Cores per pool: prefill and decode replicas on one host pinned to disjoint CPU sets.

Prefill is compute-bound and saturates whatever cores it gets; a decode replica sharing those
cores sees every prefill chunk as a stall in its inter-token latency. Pinning each pool to its
own cores (``PoolConfig.cpus``) keeps them out of each other's way. The local launcher fills
both pools' sets in automatically (``split_cores``) when it starts a one-host cluster and
neither is set; on a real cluster each pool has its own nodes and stays unpinned unless set.
"""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; raises ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: {part!r} is not N or N-M") from None
        if a < 0 or b < a:
            raise ValueError(f"bad CPU list {spec!r}: {part!r} is not an increasing range")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def split_cores(
    cores: list[int], prefill_threads: int, decode_threads: int
) -> tuple[list[int], list[int]]:
    """Disjoint (prefill, decode) core sets in proportion to each pool's threads on this host;
    each gets at least one core. With a single core both share it (nothing to split)."""
    if len(cores) < 2:
        return list(cores), list(cores)
    total = prefill_threads + decode_threads
    n_prefill = min(max(1, round(len(cores) * prefill_threads / total)), len(cores) - 1)
    return cores[:n_prefill], cores[n_prefill:]


def pin_current_process(cpus: list[int], threads: int) -> int:
    """Restrict this process to ``cpus`` (those it may use at all) and return the torch thread
    count that fits them (never more threads than pinned cores)."""
    allowed = sorted(set(cpus) & os.sched_getaffinity(0)) or sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed)
    return max(1, min(threads, len(allowed)))
