"""Child-process hygiene for launchers: free ports, reap process groups."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (prefer binding port 0 where the server allows it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reap(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminates every process still running, waits `grace_s`, then kills the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
