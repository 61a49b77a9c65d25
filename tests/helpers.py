"""Helpers the tests share (not part of the package)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """Polls `predicate` until it returns something truthy, and returns that.

    Multi-process code and tests wait on events and step counts this way, never on fixed sleeps.

    Raises:
      TimeoutError: nothing truthy within `timeout_s`; the message names `what`.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
