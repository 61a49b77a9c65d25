"""The one retry policy: jittered exponential backoff on the gRPC codes worth retrying."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

T = TypeVar("T")
# Worth retrying: the syncer may be restarting or busy. Everything else is a real refusal.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Set on a RESOURCE_EXHAUSTED refusal that is about the syncer's capacity now (busy), not about
# the request (too big): only those are retried.
RETRY_TRAILER = "x-dd-retry"


def retryable(error: grpc.RpcError) -> bool:
    """Whether a failed call is worth another attempt (the syncer restarting or busy)."""
    code = error.code() if hasattr(error, "code") else None
    if code in RETRYABLE:
        return True
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    if hasattr(error, "details") and error.details() == "Concurrent RPC limit exceeded!":
        return True  # the server's `maximum_concurrent_rpcs`: busy now
    if hasattr(error, "trailing_metadata"):
        return any(k == RETRY_TRAILER for k, _ in error.trailing_metadata() or ())
    return False


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Waits of `first_s`, doubling up to `cap_s`, each scaled by a jitter in [0.5, 1.5)."""

    first_s: float = 0.2
    cap_s: float = 5.0

    def delays(self) -> Iterator[float]:
        """The waits between attempts, without end."""
        delay = self.first_s
        while True:
            yield delay * (0.5 + random.random())
            delay = min(2 * delay, self.cap_s)


def retry(
    call: Callable[[], T],
    *,
    attempts: int | None = None,
    stop: threading.Event | None = None,
    backoff: Backoff = Backoff(),
    on_retry: Callable[[], None] | None = None,
) -> T | None:
    """`call()`, retried with backoff while it fails with a `RETRYABLE` gRPC error.

    Args:
      call: one attempt.
      attempts: at most this many attempts, then the last error is raised; None: no limit.
      stop: set by a learner shutting down: the wait between attempts ends and None is
        returned. Without it the waits are plain sleeps.
      backoff: the waits between attempts.
      on_retry: called before each retry (counters).

    Raises:
      grpc.RpcError: a refusal that no retry can fix, or the last attempt's error.
    """
    for attempt, delay in enumerate(backoff.delays(), start=1):
        try:
            return call()
        except grpc.RpcError as error:
            if not retryable(error) or (attempts is not None and attempt >= attempts):
                raise
        if on_retry is not None:
            on_retry()
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            return None
    raise AssertionError("unreachable")
