"""A sliding time window of latency samples: what a replica reports to the autoscaler."""

from __future__ import annotations

import math
import threading
import time
from collections import deque


class LatencyWindow:
    """Samples of the last ``window_s`` seconds; ``percentile`` is nearest-rank.

    Thread-safe: the engine loop thread adds, Ray Serve's metrics pusher reads."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value))

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def snapshot(self, q: float, now: float | None = None) -> tuple[float | None, int]:
        """(the q-quantile of the window or None if empty, the number of samples)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            values = sorted(v for _, v in self._samples)
        if not values:
            return None, 0
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))], len(values)
