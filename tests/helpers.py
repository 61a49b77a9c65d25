"""Helpers the tests share (not part of the package)."""

from __future__ import annotations

import pathlib
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from decoupled_diloco.comm import wire
from decoupled_diloco.core.fragments import TensorSpec, offset

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository

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


def popen_logged(command: Sequence[str], log: pathlib.Path, **kwargs) -> subprocess.Popen:
    """Starts `command` with its stdout and stderr in the file `log` (read it with `tail`).

    A file, not a pipe: a pipe nobody reads while a test waits on the run fills at 64 KiB and
    then blocks the process at its next print.
    """
    with log.open("wb") as out:
        return subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, **kwargs)


def tail(log: pathlib.Path, chars: int | None = 3000) -> str:
    """The last `chars` characters of a `popen_logged` log (None: all of it)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text[-chars:] if chars else text


# The staggered schedule, stated as its rule (the package keeps only "next due step").
def is_due(step: int, fragment: int, num_fragments: int, inner_steps: int) -> bool:
    """Whether fragment p is pushed after inner step `step` (1-based)."""
    return step >= 1 and (step - offset(fragment, num_fragments, inner_steps)) % inner_steps == 0


def due_fragments(step: int, num_fragments: int, inner_steps: int) -> list[int]:
    """The fragments due after inner step `step`."""
    return [p for p in range(num_fragments) if is_due(step, p, num_fragments, inner_steps)]


def sync_round(step: int, fragment: int, num_fragments: int, inner_steps: int) -> int:
    """The learner-side round number of fragment p at a due step (0 for its first push)."""
    return (step - offset(fragment, num_fragments, inner_steps)) // inner_steps


# Raw payloads (scheme "none"), as a client of the wire format would build them.
def to_bytes(arrays: Sequence[np.ndarray]) -> bytes:
    """The arrays' little-endian bytes, concatenated (one copy on little-endian hosts)."""
    return b"".join(
        memoryview(np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))).cast("B")
        for a in arrays
    )


def from_bytes(
    payload: bytes, specs: Sequence[TensorSpec], require_finite: bool = True
) -> list[np.ndarray]:
    """Splits a raw (scheme "none") payload into arrays: read-only views, no copies.

    Raises:
      PayloadError: wrong total size, or (with `require_finite`) a NaN or infinity.
    """
    return wire.decode_payload(payload, wire.headers(specs), specs, require_finite)


def assert_budget_trained_once(summary: dict, learners: int = 0) -> None:
    """A run on data leases trained its whole budget: the ledger shows every window in the
    global model exactly once, and every learner (`learners`: at least this many) trained
    without errors."""
    ledger = summary["data_ledger"]
    assert ledger is not None, "no data ledger: the run was not on data leases"
    windows = (
        summary["num_learners"] * summary["train_steps"] * summary["config"]["data"]["batch_size"]
    )
    assert ledger["windows"] == windows, ledger
    assert (ledger["consumed_once"], ledger["missing"], ledger["repeated"]) == (windows, 0, 0), (
        ledger
    )
    assert len(summary["learners"]) >= learners
    assert all(x["steps"] > 0 and not x["errors"] for x in summary["learners"]), [
        (x["steps"], x["errors"]) for x in summary["learners"]
    ]
