"""The syncer's capacity for data calls: slots, streams per caller, bytes in flight, idle cuts.

gRPC serves every call from one thread pool. A push or a pull holds its thread for as long as
its stream is open (a pull waits for a merge), so without limits a few peers that open streams
and send nothing, or pulls waiting for a version that never comes, take every thread, and the
control calls (Register, Heartbeat, Status) time out behind them. `Guard` keeps:

- **data slots**: at most `slots` data calls at once (the pool has more threads than that, so
  control calls always find one); beyond that a data call is refused at once with
  RESOURCE_EXHAUSTED;
- **streams per caller**: at most `per_caller` data calls per identity (`comm.auth`);
- **bytes in flight**: pushes reserve the payload size their header declares before a byte of
  it is buffered; past `max_bytes` in total a push is refused at once (RESOURCE_EXHAUSTED,
  retryable): a push that waited for room would not hold its sender back, gRPC would go on
  receiving its chunks into memory;
- **idle cuts**: a push that sends no chunk for `idle_s` seconds is cancelled; a pull's own
  bounded wait for a merge is not idleness;
- **pull budgets**: a pull's reply may take `idle_s` plus its bytes at `min_pull_rate` bytes
  per second, then it is cancelled; the rate is a learner's link's, shared by its replies under
  way at once (k replies of one learner: each may average `min_pull_rate` / k, so a learner's
  P fragments' merges coming down one slow link together are not cut, as they were at 4 KB/s
  each against 8 KB/s). A reply chunk that gRPC's flow control holds back does
  not count as idle: between the HTTP/2 window and the kernel's socket buffers, a reader on a
  slow link (which takes every byte as it arrives) and a reader that takes nothing look the
  same to the server for many seconds at a time (a send returns only once a socket buffer
  of megabytes has drained by a third), so what a reader must keep up is a pace averaged
  over the whole reply, not a gap between chunks.

Refusals name the limit and the config field that sets it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from absl import logging

from decoupled_diloco.comm.auth import OPERATOR
from decoupled_diloco.comm.retry import RETRY_TRAILER
from decoupled_diloco.config import ExperimentConfig, max_learners

CONTROL_THREADS = 16  # threads the data calls can never take (Register, Heartbeat, Status)


def control_slots(config: ExperimentConfig) -> int:
    """Control calls served at once: 2 per learner id, and `CONTROL_THREADS` for the operator."""
    return 2 * max_learners(config) + CONTROL_THREADS


def streams_per_learner(config: ExperimentConfig) -> int:
    """`max_streams_per_learner`, or what a learner's link may open at most.

    A push and its pull per undelivered push of every fragment (`max_unsent` + 1 each), + 2.
    """
    s = config.decoupled.syncer
    return s.max_streams_per_learner or config.decoupled.fragments * (s.max_unsent + 1) + 2


def data_slots(config: ExperimentConfig) -> int:
    """Data calls served at once: every learner id's streams, + 8 (evaluator, status tools)."""
    return max_learners(config) * streams_per_learner(config) + 8


class Activity:
    """One data call's entry in the guard: when it last moved, and what it reserved."""

    def __init__(
        self, guard: Guard, context: grpc.ServicerContext, kind: str = "", caller: int = 0
    ):
        self.guard, self.context, self.kind, self.caller = guard, context, kind, caller
        self.started = guard.clock()
        self.last = guard.clock()
        self.reserved = 0
        self.idle_cut = False
        self.until: float | None = None  # cut after this, held or not (a pull's budget)
        self.nbytes, self.reply_t0 = 0, 0.0  # the reply's bytes and when it began (`budget`)

    def touch(self) -> None:
        """The stream moved (a chunk arrived or left)."""
        self.last = self.guard.clock()

    def hold(self) -> None:
        """Exempts the call from the idle cut until the next `touch` (a bounded wait)."""
        self.last = None

    def budget(self, nbytes: int) -> None:
        """Bounds a reply of `nbytes` from now to `idle_s` plus its bytes at the minimum rate.

        A learner's rate is shared by its replies under way: with k of them (this one
        included), each one's bound is `idle_s` plus its bytes at `min_pull_rate` / k from
        its own start, and the others' bounds are extended to that (never shortened; at most
        `per_caller` times the bound alone). The run token's calls (evaluator, tools) are not
        one link: each has the rate alone.
        """
        g = self.guard
        with g.lock:
            now = g.clock()
            self.nbytes, self.reply_t0, self.until = nbytes, now, now  # (one of those under way)
            sharing = [self]
            if self.caller != OPERATOR:
                sharing = [a for a in g.active if a.caller == self.caller and a.until is not None]
            for a in sharing:
                bound = a.reply_t0 + g.idle_s + a.nbytes * len(sharing) / g.min_pull_rate
                a.until = max(a.until, bound)

    def reserve(self, nbytes: int) -> None:
        """Reserves `nbytes` of push buffer, or aborts RESOURCE_EXHAUSTED at once.

        A push does not wait for room: while its handler waited, gRPC would go on receiving the
        stream's chunks into its own buffers (40 concurrent pushes of 4.2 MiB against a 16 MiB
        bound: over 100 MB more syncer memory when they waited; what they cost now is in
        benchmarks/results/security.md). The refusal is retryable if `nbytes` fits the bound.
        """
        g = self.guard
        with g.lock:
            if g.bytes_in_flight + nbytes <= g.max_bytes:
                g.bytes_in_flight += nbytes
                g.peak_bytes = max(g.peak_bytes, g.bytes_in_flight)
                self.reserved += nbytes
                return
            g.refused += 1
            busy = g.bytes_in_flight
        logging.log_every_n_seconds(
            logging.WARNING, "[syncer] push of %d bytes refused: %d in flight", 5.0, nbytes, busy
        )
        if nbytes <= g.max_bytes:  # it fits once others finish: worth retrying
            self.context.set_trailing_metadata(((RETRY_TRAILER, "1"),))
        self.context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"push of {nbytes} bytes refused: {busy} bytes of pushes already in flight, bound "
            f"{g.max_bytes} (decoupled.syncer.max_inflight_bytes); retry later",
        )

    def release(self) -> None:
        """Gives back what `reserve` took (the push's bytes are all in its file now)."""
        g = self.guard
        with g.lock:
            g.bytes_in_flight -= self.reserved
            self.reserved = 0


class Guard:
    """Admission of data calls (see the module doc).

    Args:
      slots: data calls served at once.
      per_caller: data calls at once per learner identity; the operator (who may act as any
        learner, `comm.auth`) gets `operator_calls`.
      operator_calls: data calls at once with the run token.
      max_bytes: push payload bytes buffered at once, all pushes together.
      idle_s: a push stream idle this long is cancelled.
      min_pull_rate: the bytes per second a pull's reply must average (`budget`).
      clock: time source.
      calls: what its refusals call the calls it admits.
      per_caller_field: what its refusals name as the setting of `per_caller`.
    """

    def __init__(
        self,
        slots: int,
        per_caller: int,
        max_bytes: int,
        idle_s: float,
        operator_calls: int = 0,
        min_pull_rate: float = 8192.0,
        clock: Any = time.monotonic,
        calls: str = "data calls",
        per_caller_field: str = "decoupled.syncer.max_streams_per_learner",
    ):
        self.calls, self.per_caller_field = calls, per_caller_field
        self.operator_calls = operator_calls or per_caller
        self.min_pull_rate = min_pull_rate
        self.slots, self.per_caller, self.max_bytes, self.idle_s = (
            slots,
            per_caller,
            max_bytes,
            idle_s,
        )
        self.clock = clock
        self.lock = threading.Lock()
        self.active: set[Activity] = set()
        self.by_caller: dict[int, int] = {}
        self.bytes_in_flight = self.peak_bytes = 0
        self.refused = self.idle_cuts = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="guard", daemon=True)
        self._watcher.start()

    @contextlib.contextmanager
    def call(self, caller: int, context: grpc.ServicerContext, kind: str) -> Iterator[Activity]:
        """Admits one data call of `caller` for the duration of the block, or aborts."""
        activity = Activity(self, context, kind, caller)
        with self.lock:
            if len(self.active) >= self.slots:
                message = (
                    f"{kind} refused: {self.slots} {self.calls} already in progress "
                    "(the syncer's slots for them are full); retry later"
                )
            elif self.by_caller.get(caller, 0) >= (
                self.operator_calls if caller == OPERATOR else self.per_caller
            ):
                message = (
                    f"{kind} refused: caller {caller} (-1: the run token) already has "
                    f"{self.by_caller[caller]} {self.calls} open ({self.per_caller_field})"
                )
            else:
                message = ""
                self.active.add(activity)
                self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
            if message:
                self.refused += 1
        if message:
            logging.log_every_n_seconds(logging.WARNING, "[syncer] %s", 5.0, message)
            context.set_trailing_metadata(((RETRY_TRAILER, "1"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        try:
            yield activity
        finally:
            activity.release()  # (a push that ended before its bytes were all in its file)
            with self.lock:
                self.active.discard(activity)
                self.by_caller[caller] -= 1
                if not self.by_caller[caller]:
                    del self.by_caller[caller]

    def _watch(self) -> None:
        period = max(min(self.idle_s / 4, 1.0), 0.01)
        while not self._stop.wait(period):
            now = self.clock()
            with self.lock:  # (`budget` reads and extends `until` under the same lock)
                cut = []
                for a in self.active:
                    over = a.until is not None and now > a.until
                    if over or (a.last is not None and now - a.last > self.idle_s):
                        a.idle_cut, a.last, a.until = True, None, None  # cut once
                        self.idle_cuts += 1
                        cut.append((a, over))
            for activity, over in cut:
                logging.warning(
                    "[syncer] %s cut: %s",
                    activity.kind or "call",
                    "its reply took longer than stream_idle_s plus its bytes at "
                    "decoupled.syncer.min_pull_bytes_per_s"
                    if over
                    else f"nothing moved for {self.idle_s:g} s (decoupled.syncer.stream_idle_s)",
                )
                activity.context.cancel()

    def stats(self) -> dict[str, int]:
        """Counters for the syncer's status."""
        with self.lock:
            return {
                "data_calls": len(self.active),
                "bytes_in_flight": self.bytes_in_flight,
                "peak_bytes_in_flight": self.peak_bytes,
                "refused": self.refused,
                "idle_cuts": self.idle_cuts,
            }

    def close(self) -> None:
        """Stops the idle watcher."""
        self._stop.set()
