"""Child-process hygiene: die with the parent, free ports, reap process groups."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
# Set by `launch.Processes` in each child's environment: the pid of the process that started it.
PARENT_PID_ENV = "DD_PARENT_PID"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Makes a child of our launcher follow it: Linux sends `sig` when the parent dies.

    Only for processes started by `launch.Processes` (which sets `DD_PARENT_PID`); a learner or
    syncer started by hand, by `nohup` or by a process manager is left alone. A launcher killed
    with SIGKILL cannot clean up; this makes its children follow it. Each child calls this
    first thing after it starts, never in a `preexec_fn`: running Python between fork and exec
    in a launcher with gRPC and JAX threads can deadlock the child before it execs (a lock held
    by another thread at fork time). A parent that died before the call is caught by comparing
    with `DD_PARENT_PID`.
    """
    expected = os.environ.get(PARENT_PID_ENV, "")
    if not expected.isdigit():
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):
        os.kill(os.getpid(), sig)  # the parent is already gone


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
