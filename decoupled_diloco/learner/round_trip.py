"""One fragment's round trip: push its outer gradient, wait for the merge that holds it, pull it.

Runs on a `DecoupledSync` worker thread, so it may block: while the syncer is unreachable the
push and the pull are retried with backoff (`comm.retry`; the push through its `Outbox` ticket,
which a newer push of the fragment may fold it into), until the link stops.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from decoupled_diloco import runtime
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.retry import retry
from decoupled_diloco.core import outer
from decoupled_diloco.core.compression import Codec
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.learner.outbox import Outbox, Unsent


@dataclasses.dataclass
class Encoded:
    """A fragment's encoded outer gradient: section arrays in wire order."""

    arrays: list[np.ndarray]


@dataclasses.dataclass
class Late:
    """A push the syncer refused as late, whose work the learner rebases (`Inbound.late`)."""

    steps: int
    tokens: int
    data: list[list[int]]  # the leased batches it held
    reference: list[np.ndarray]  # what its Δ was taken from (the anchor, or `origin`)


@dataclasses.dataclass
class Inbound:
    """A merged fragment waiting for its step boundary."""

    version: int
    values: list[np.ndarray]
    apply_after_step: int
    pushed_at: int = -1  # the step of the push this merge answers (-1: unknown)
    # The current values after a late refusal of that push: applied keeping every step since
    # the push's reference, whose counts and data go with the next push (`learner.arrivals`).
    late: Late | None = None


@dataclasses.dataclass
class Outgoing:
    """One push of a fragment, as the step loop handed it over."""

    fragment: int
    round: int
    base: int  # the version Δ is anchored at
    # (`local` None once the push is answered, both once the trip is over: `release`.)
    anchor: list[np.ndarray] | None
    local: list[np.ndarray] | Encoded | None  # θ on the host, or Δ already encoded on the mesh
    steps: int
    tokens: int
    final: bool  # the last push of the run: no merge is waited for
    pushed_at: int  # the step after which it left
    ticket: Unsent | None = None
    # Set once the syncer has answered the push (before its merge is pulled): None until then,
    # True when the answer leaves work to rebase (refused as late, also when answered as a
    # duplicate of that refusal), else False.
    answered_late: bool | None = None
    data: list[list[int]] = dataclasses.field(default_factory=list)  # leased batches it holds
    origin: list[np.ndarray] | None = None  # Δ = origin − θ instead of anchor − θ (`lease_started`)

    def release(self) -> None:
        """Lets go of the arrays once the trip is over (the job may be kept: `Pusher.jobs`)."""
        self.local = self.anchor = self.origin = None


@dataclasses.dataclass
class Trip:
    """How a round trip went: the push's outcome, the merge it brought back, the bytes moved."""

    # The syncer's answer to the push: "accepted", "late", "duplicate", or "covered" (its data
    # is in the global model already: the lease was handed to another learner meanwhile).
    outcome: str
    version: int = -1  # the merged version pulled (-1: none, e.g. for a final push)
    values: list[np.ndarray] = dataclasses.field(default_factory=list)
    sent: int = 0
    received: int = 0
    push_s: float = 0.0  # delivering the push, retries included
    pull_s: float = 0.0  # from the push's answer until the merge holding it arrived


def round_trip(
    client: Any,
    learner_id: int,
    job: Outgoing,
    specs: list[TensorSpec],
    codec: Codec,
    stop: threading.Event,
    still_current: Callable[[], bool],
    wait_s: float,
    outbox: Outbox | None = None,
    on_retry: Callable[[], None] | None = None,
    merge_wait_s: float = float("inf"),
) -> Trip | None:
    """Pushes Δ = anchor − θ of `job` (or its encoding), then pulls the merge that holds it.

    Args:
      client: the learner's syncer client.
      learner_id: who pushes.
      job: the push.
      specs: its fragment's tensors.
      codec: how an encoded `job.local` was encoded.
      stop: set when the learner shuts down: waits end, None is returned.
      still_current: False once a newer push of the fragment has taken over the wait.
      wait_s: how long one pull waits at the syncer (short: shutdown is never held up).
      outbox: where `job.ticket` is registered (folding, bounds).
      on_retry: called before each retry (counters).
      merge_wait_s: no new pull starts this long after the push's reply (a merge that may
        never come: a push lost with a restarted syncer's unsaved state, its peers gone); a
        pull under way (a slow link's download) runs to its end.

    Returns:
      The trip, or None when the push was folded into a newer one, dropped, or `stop` was set
      before it was delivered.

    Raises:
      grpc.RpcError: a refusal that no retry can fix (a bug or a hostile syncer).
    """
    if isinstance(job.local, Encoded):  # compressed on the mesh by the step loop
        arrays, tensors = job.local.arrays, wire.headers(specs, codec)
    else:
        reference = job.anchor if job.origin is None else job.origin
        # Δ = reference − θ, computed a chunk at a time as the push streams it (and again by a
        # retry): it never exists whole.
        arrays = [outer.Difference(a, x) for a, x in zip(reference, job.local, strict=True)]
        tensors = None
    send = functools.partial(
        client.push,
        learner_id=learner_id,
        fragment=job.fragment,
        round=job.round,
        base_version=job.base,
        steps=job.steps,
        tokens=job.tokens,
        specs=specs,
        arrays=arrays,
        tensors=tensors,
        retries=0,  # retried here, not inside the client too
        data=job.ticket.data if job.ticket is not None else job.data,
    )
    t0 = time.perf_counter()
    if job.ticket is not None and outbox is not None:
        reply = outbox.deliver(job.ticket, send, stop, on_retry)
    else:
        reply = retry(send, stop=stop, on_retry=on_retry)
    if reply is None:
        return None
    # Answered: θ's host copy goes now, not when the merge is back (on CPU without
    # `keep_overlap` it is a view that keeps the old parameters' buffers alive: with the
    # merged values as they arrive, two fragments in flight instead of one), and what it
    # held goes back to the OS (glibc kept the freed buffers in its arenas: a synthetic 350M
    # learner without `keep_overlap` peaked at 2.78x the model without this trim, 2.53x with).
    del send, arrays
    job.local = None
    runtime.trim_memory()
    outcome = (
        "duplicate"
        if reply.duplicate
        else "accepted"
        if reply.accepted
        else "covered"
        if reply.reason.startswith(wire.REASON_COVERED)
        else "late"
    )
    trip = Trip(outcome, sent=client.last_bytes(), push_s=time.perf_counter() - t0)
    # (A retry of a refused push is answered "duplicate" with the first answer's reason.)
    job.answered_late = not reply.accepted and reply.reason == "late"
    t0 = time.perf_counter()
    give_up = time.monotonic() + merge_wait_s
    if job.final or outcome == "covered":  # (a covered push's data is in no merge of ours)
        return trip
    # An accepted push waits in the fragment's open round, which the next merge closes: wait
    # for that merge (it holds this push), not for any version newer than `base` (a merge of
    # other learners' pushes that closed while this one was on its way).
    want = max(job.base, reply.version) + 1 if reply.accepted else job.base + 1
    # That merge may be long in coming (this push folded into a newer one, or lost with a
    # restarted syncer's unsaved state): a newer push's pull then brings what is there.
    while trip.version < 0 and not stop.is_set() and still_current():
        if time.monotonic() > give_up:
            break
        # `have`: with a compressed downlink the syncer sends the difference from it.
        pull = functools.partial(
            client.pull, learner_id, job.fragment, want, wait_s, have=(job.base, job.anchor),
            retries=0,
        )  # fmt: skip
        try:
            pulled = retry(pull, stop=stop, on_retry=on_retry)
        except Exception:  # noqa: BLE001 - re-raised unless the learner is closing
            if not stop.is_set():
                raise
            pulled = None  # cut by the learner's close: the trip ends without a merge
        if pulled is None:
            break
        trip.version, trip.values = pulled
        trip.received += client.last_bytes()
    trip.pull_s = time.perf_counter() - t0
    return trip
