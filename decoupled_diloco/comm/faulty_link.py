"""A degraded learner <-> syncer link, in our own transport layer (no root, no `tc`).

A `DegradedLink` is a client interceptor that a learner under a fault schedule puts on its gRPC
channels (`SyncerClient(..., link=...)`; the learner's entry point finds its controls from
`$DD_CHAOS_DIR` and `$DD_CHAOS_LEARNER`, set by the launcher). It reads the learner's control
file (`chaos.Controls`) on every call, so a link fault starts and ends while the learner runs:

  * `latency_s`: added to every call (half before the request, half after the reply);
  * `bandwidth_mbps`: the streamed chunks of a push or a pull are paced to this rate;
  * `drop`: this share of calls fails with UNAVAILABLE, as a lost packet would surface: half
    before the request reaches the syncer, half after the syncer handled it and the reply was
    lost. The client retries both; the second kind re-sends work the syncer already has, which
    its per-(learner, fragment, round) idempotency must not count twice.

Drops are drawn from generators seeded by the schedule's seed, the learner id and the RPC method:
each method's calls see the same drops in the same order however calls of different methods
interleave across threads (so a seed decides, say, which push replies are lost).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from decoupled_diloco.chaos import faults as chaos


class DroppedCall(grpc.RpcError, grpc.Call):
    """The error a dropped call raises: UNAVAILABLE, which the client retries."""

    def __init__(self, where: str):
        super().__init__(f"call dropped by the chaos link ({where})")
        self.where = where

    def code(self) -> grpc.StatusCode:  # noqa: D102
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:  # noqa: D102
        return f"dropped by the chaos link ({self.where})"

    # grpc.Call / RpcContext surface, so that callers treat it as any failed call.
    def initial_metadata(self) -> tuple:  # noqa: D102
        return ()

    def trailing_metadata(self) -> tuple:  # noqa: D102
        return ()

    def is_active(self) -> bool:  # noqa: D102
        return False

    def time_remaining(self) -> float | None:  # noqa: D102
        return None

    def cancel(self) -> bool:  # noqa: D102
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:  # noqa: D102
        return False


class DegradedLink(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Adds latency, caps bandwidth and drops calls as the control file says.

    Args:
      controls: the learner's live fault controls.
      learner: the learner id (seeds the drops).
    """

    def __init__(self, controls: chaos.Controls, learner: int):
        self.controls, self.learner = controls, learner
        self._seed: str | None = None
        self._rngs: dict[str, random.Random] = {}
        self._lock = threading.Lock()
        self.dropped = {"request": 0, "reply": 0}
        self._free_at = {"up": 0.0, "down": 0.0}  # when each direction's reserved bytes are sent

    def _values(self) -> dict[str, Any]:
        values = self.controls.get()
        if self._seed is None and values:
            self._seed = f"{values.get('seed', 0)}:link:{self.learner}"
        return values

    def _drop(self, values: dict[str, Any], details: Any) -> str:
        """'' (deliver), 'request' or 'reply': which side of this call is lost."""
        share = float(values.get("drop", 0.0))
        if share <= 0 or self._seed is None:
            return ""
        method = str(getattr(details, "method", ""))
        with self._lock:
            rng = self._rngs.setdefault(method, random.Random(f"{self._seed}:{method}"))
            if rng.random() >= share:
                return ""
            where = "request" if rng.random() < 0.5 else "reply"
            self.dropped[where] += 1
            return where

    def _pace(self, values: dict[str, Any], nbytes: int, direction: str) -> None:
        """Waits until `nbytes` more fit the cap: one bucket per direction for all calls.

        Concurrent pushes (or pulls) share the link's rate, as on a real link: each chunk
        reserves its transfer time after the ones already reserved.
        """
        rate = float(values.get("bandwidth_mbps", 0.0))
        if rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            done = max(now, self._free_at[direction]) + nbytes * 8 / (rate * 1e6)
            self._free_at[direction] = done
        if done > now:
            time.sleep(done - now)

    def _delay(self, values: dict[str, Any]) -> None:
        latency = float(values.get("latency_s", 0.0))
        if latency > 0:
            time.sleep(latency / 2)

    def _unary_reply(
        self, continuation: Callable, details: Any, request: Any, values: dict[str, Any]
    ) -> _Reply:
        """The call, its request lost or delayed as the link says; the reply in `_Reply`.

        Not waited for here: a caller's future stays cancellable while the call runs.
        """
        drop = self._drop(values, details)
        self._delay(values)
        if drop == "request":
            raise DroppedCall("request")
        outcome = continuation(details, request)
        return _Reply(outcome, lambda: self._delay(values), drop == "reply")

    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: D102
        return self._unary_reply(continuation, client_call_details, request, self._values())

    def intercept_stream_unary(  # noqa: D102
        self, continuation, client_call_details, request_iterator
    ):
        values = self._values()

        def paced() -> Iterator[Any]:
            for chunk in request_iterator:
                self._pace(values, len(chunk) if isinstance(chunk, bytes | bytearray) else 0, "up")
                yield chunk

        return self._unary_reply(continuation, client_call_details, paced(), values)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # noqa: D102
        values = self._values()
        drop = self._drop(values, client_call_details)
        self._delay(values)
        if drop == "request":
            raise DroppedCall("request")
        stream = continuation(client_call_details, request)

        def replies() -> Iterator[Any]:
            for raw in stream:
                self._pace(values, len(raw) if isinstance(raw, bytes | bytearray) else 0, "down")
                yield raw
            self._delay(values)
            if drop == "reply":
                raise DroppedCall("reply")

        return _Replies(replies(), stream)


class _Replies:
    """A paced reply stream that can still be cancelled (the client cuts a stalled pull)."""

    def __init__(self, replies: Iterator[Any], call: Any):
        self._replies, self._call = replies, call

    def __iter__(self) -> _Replies:
        return self

    def __next__(self) -> Any:
        return next(self._replies)

    def cancel(self) -> bool:
        """Cancels the underlying call."""
        return self._call.cancel()


class _Reply:
    """A call's outcome (a gRPC future) whose `result()` adds the link's delay and reply drop."""

    def __init__(self, outcome: Any, delay: Callable[[], None], drop_reply: bool):
        self._outcome, self._delay, self._drop_reply = outcome, delay, drop_reply

    def result(self, timeout: float | None = None) -> Any:
        """The reply, after the link's return delay; `DroppedCall` if the link loses it."""
        value = self._outcome.result(timeout)  # raises the call's own error, if any
        self._delay()
        if self._drop_reply:
            raise DroppedCall("reply")
        return value

    def __getattr__(self, name: str) -> Any:  # cancel, done, code, ...: the call's own
        return getattr(self._outcome, name)
