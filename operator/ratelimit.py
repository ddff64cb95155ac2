"""A token bucket for the operator's API client (client-go's QPS/burst, done with asyncio).

`acquire()` reserves the next token and sleeps until it is due, so callers are served in the order
they asked and a burst of 1,000 reconciles becomes a steady `qps` stream after `burst` requests.
Reserving ahead (tokens may go negative) keeps it O(1) with no background task. The clock and the
sleep are injectable, so tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class TokenBucket:
    """`qps` tokens per second, at most `burst` saved up; `qps <= 0` disables limiting."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()
        self.num_waits = 0  # requests that had to wait for a token (throttled)

    def reserve(self) -> float:
        """Take one token now; returns how long the caller must wait before using it."""
        if self.qps <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            self.num_waits += 1
            await self._sleep(delay)
