"""A link's pushes: when each fragment goes, its round trip on a worker thread, and its end.

A `Pusher` belongs to one `DecoupledSync` and owns what pushing needs: the outbox of pushes not
delivered yet, the worker threads, each fragment's last round trip, and the fragments held.
`push_due` runs on the step loop after each step: the fragments due (`learner.schedule`) are
launched, except one whose last round trip is still under way, which is held until it ends
(`under_way`). `launch` takes the fragment's host copy (or its encoding on the mesh,
`learner.encoder`) before the next step donates the buffers, records the push in the outbox
and hands it to a worker thread: the round trip (`round_trip`), then what its outcome changes
(the counters, the round's bytes, a refusal as covered); the merged values go to the inbox,
due at the step `due_at` says. `pause` and `flush` end a stretch of training: the first one
poll by poll (a leased learner between leases), the second at once (the run's end). They
apply merges through the link's `merge` and return the parameters it made.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax

from decoupled_diloco import runtime
from decoupled_diloco.config import ExperimentConfig, overlap_steps
from decoupled_diloco.core.fragments import TensorSpec, gather
from decoupled_diloco.learner import mesh_merge
from decoupled_diloco.learner.bridge import HostBridge
from decoupled_diloco.learner.encoder import MeshEncoder
from decoupled_diloco.learner.fragment import FragmentState
from decoupled_diloco.learner.inbox import Inbox
from decoupled_diloco.learner.outbox import Outbox
from decoupled_diloco.learner.progress import SyncCounters
from decoupled_diloco.learner.round_trip import Inbound, Late, Outgoing, Trip, round_trip

Params = Any
Merge = Callable[[Params, dict[int, Inbound]], Params]


class Pusher:
    """One link's pushes (see the module doc); its parts are the link's.

    Args:
      config: the experiment.
      learner_id: who pushes.
      client: the syncer client.
      partition: each fragment's tensors (`core.fragments.partition`).
      treedef: the parameter tree's structure.
      states: each fragment's state (`learner.fragment`), shared with the link.
      counters: the link's counters.
      encoder: outer-gradient compression on the mesh.
      inbox: where merges that came back wait for their step.
      bridge: device<->host moves, and whether this process talks to the syncer.
      stop: set when the link stops.
      host_is_device: the parameters live in host memory (CPU): `device_get` makes views.
      merge: applies ready merges to parameters (the link's), for a pause and the end.
      on_trip: called with each round trip (metrics), or None.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        learner_id: int,
        client: Any,
        partition: list[list[TensorSpec]],
        treedef: Any,
        states: list[FragmentState],
        counters: SyncCounters,
        encoder: MeshEncoder,
        inbox: Inbox,
        bridge: HostBridge,
        stop: threading.Event,
        host_is_device: bool,
        merge: Merge,
        on_trip: Callable[[Trip], None],
    ):
        self.config, self.id, self.client = config, learner_id, client
        self.partition, self.treedef, self.states = partition, treedef, states
        self.counters = counters
        self.encoder, self.inbox, self.bridge, self.stop = encoder, inbox, bridge, stop
        self.host_is_device, self.merge, self.on_trip = host_is_device, merge, on_trip
        num, max_unsent = len(partition), config.decoupled.syncer.max_unsent
        self.outbox = Outbox(num, max_unsent, f"learner {learner_id}")
        # Per fragment: undelivered pushes retrying through an outage, and one waiting pull.
        self.pool = futures.ThreadPoolExecutor(max_workers=num * (max_unsent + 1) + 1)
        self.trips: dict[int, futures.Future] = {}  # per fragment, its last push's round trip
        self.jobs: dict[int, Outgoing] = {}  # and that push
        # Fragments due while their last round trip was under way (`under_way`).
        self.held: set[int] = set()
        self.paused_at: float | None = None  # the current pause's first poll (`pause`)

    # On the step loop --------------------------------------------------------------------------

    def launch(self, params: Params, p: int, final: bool = False) -> None:
        """Hands fragment p's push to a worker thread (its host copy or encoding made here)."""
        state = self.states[p]
        leaves = gather(self.treedef.flatten_up_to(params), self.partition[p])
        # Steps run ahead asynchronously: wait for them outside the timer, so that it measures
        # the copy itself and not the compute it would otherwise absorb.
        jax.block_until_ready(leaves)
        t0 = time.perf_counter()
        if not final:
            state.last_push = self.counters.step
        source = leaves
        if self.config.decoupled.keep_overlap and not final:
            # A device copy: the next step donates these buffers.
            state.at_push = mesh_merge.device_copy(leaves)
            if self.host_is_device:
                # On CPU `device_get` copies nothing: a view of the parameters would keep the
                # next step from donating them (it would allocate the fragment again). A view of
                # the overlap copy, kept until the merge anyway, costs nothing. (On an
                # accelerator the host copy would be cached on it for as long.)
                source = state.at_push
        reference = state.anchor if state.origin is None else state.origin
        if self.encoder.enabled:
            local = self.encoder.encode(p, reference, leaves)
            self.counters.compress_s += time.perf_counter() - t0
        else:
            # θ on the host now (a copy, or on CPU a view): the next step donates the parameters.
            local = self.bridge.to_host(source)
        self.counters.sync_host_s += time.perf_counter() - t0
        steps, tokens, data = state.take_counts()
        # Undelivered older pushes of p may be folded into this one (`Outbox`).
        ticket = self.outbox.add(p, state.version, steps, tokens, not self.encoder.enabled, data)
        job = Outgoing(
            p, state.round, state.version, state.anchor, local, ticket.steps, ticket.tokens,
            final, self.counters.step, ticket, origin=state.origin,
        )  # fmt: skip
        # The round moves on before the job starts; the trip checks `awaited` to know whether a
        # newer push of p has taken over the wait for a merge (a final push waits for none: a
        # learner flushing between leases still takes its last push's merge as its new anchor).
        state.round += 1
        if not final:
            state.awaited = job.round
        trip = self.pool.submit(self._sync, job)
        if not final:  # (a final push brings back no merge)
            self.trips[p], self.jobs[p] = trip, job

    def push_due(self, params: Params, due: list[int]) -> None:
        """After a step: pushes the fragments `due` now and those held, unless under way.

        A fragment due while its last round trip is still under way (a link behind the
        schedule) is held, not queued (`under_way`): pushed with every step since once the trip
        ends.
        """
        for p in sorted(set(due) | self.held):
            if self.under_way(p):
                self.counters.deferred += p not in self.held
                self.held.add(p)
            else:
                self.held.discard(p)
                if self.states[p].steps_since:  # (none: skipping a lease's covered batches)
                    self.launch(params, p)

    def under_way(self, p: int) -> bool:
        """Fragment p's last round trip has not ended, as the island agrees (`in_flight`)."""
        return self.bridge.under_way(p, self.in_flight)

    def in_flight(self, p: int) -> bool:
        """Fragment p's last push is not delivered, or its merge not back and applied yet.

        A fragment due then is held until the trip ends, and pushed with every step since: one
        round trip per fragment at a time. Pushing it anyway behind a link slower than the
        schedule would queue pushes that grow older while they wait, until the syncer refuses
        them as late (`max_staleness`) or the outbox drops them; on data leases their data is
        then handed out and trained again, behind the same link (a livelock). Held, the
        learner keeps stepping and the fragment syncs every max(H, its trip) steps, as
        `sim.bandwidth.sync_interval_steps` plans. A merge that is back but waiting in the
        inbox counts: a push anchored before it would be overwritten when it is applied. (A
        trip stops starting pulls `rpc_timeout_s` after its push's reply: `round_trip`.)
        """
        trip = self.trips.get(p)
        if trip is not None and not trip.done():  # (read first: a trip fills the inbox, then ends)
            return True
        return p in self.inbox.waiting()

    def restart_count(self, params: Params, p: int) -> None:
        """Fragment p's outer gradient counts from θ now; what it counted since is dropped.

        After a push refused as "covered" the dropped steps' data is not in the global model
        from this learner: the ledger sees a hole, which is handed again (lost compute, not lost
        data). A push of p launched before the refusal came back is not recalled.
        """
        self.states[p].restart(self.host_copy(params, p))

    def host_copy(self, params: Params, p: int) -> list[Any]:
        """Fragment p's tensors of `params`, copied to the host."""
        return self.bridge.to_host(gather(self.treedef.flatten_up_to(params), self.partition[p]))

    def drop_covered(self, params: Params) -> None:
        """Fragments whose last push was refused as covered count from θ now."""
        for p, state in enumerate(self.states):
            if state.covered:
                state.covered = False
                self.restart_count(params, p)

    def wait_for_due_merges(self) -> None:
        """`wait_for_merge`: waits for each round trip whose merge is due by now to end.

        A round trip ends once its merge is in the inbox (or without one: a push folded into a
        newer one, refused as covered, or the link stopping).
        """
        for p, trip in list(self.trips.items()):
            if due_at(self.config, self.states[p].last_push) <= self.counters.step:
                while not trip.done() and not self.stop.is_set():
                    futures.wait([trip], timeout=1.0)

    # A stretch of training ends ----------------------------------------------------------------

    def pause(self, params: Params) -> tuple[bool, Params]:
        """One poll of a leased learner's wait for a lease.

        A pause is a step boundary with no step after it soon. Once no push is crossing (not
        answered yet, or refused as late and its current values not back), every merge that
        came back is applied (the work of a push refused as late rebased) and what was trained
        since is pushed as ordinary pushes, whose merges come back as anchors; settled once none
        is left to push or crossing, so that the syncer hands the learner back none of the
        batches it still holds. Accepted pushes' merges are not waited for: their data is the
        syncer's. A fragment with steps to push whose round trip is still under way waits for
        it, as a due fragment is held (`push_due`): pushed at once, it would be anchored a round
        trip further back (its outer gradient holding the push under way's steps again), and
        behind a slow link such pushes would pass `max_staleness` and cost a pull and a second
        push each. For `rpc_timeout_s` from the pause's first poll: on a link far below what
        the run needs pulls can take many minutes, and then the fragment goes as it is.
        A multi-process island (not `alone`: its processes push together) flushes once and
        waits for delivery.

        Returns:
          Whether all it trained is settled, and the parameters after the merges applied.
        """
        if not self.bridge.alone:
            if any(s.steps_since for s in self.states):
                self.flush(params, final=False)
            return self.outbox.unsent() == 0, params
        if self.paused_at is None:
            self.paused_at = time.monotonic()
        # (Crossing first: a trip puts its merge in the inbox before it ends.)
        if any(self.crossing(p) for p in range(len(self.states))):
            return False, params
        params = self.apply_all(params)
        self.drop_covered(params)
        waits = time.monotonic() - self.paused_at < self.config.decoupled.syncer.rpc_timeout_s
        trained = [p for p, s in enumerate(self.states) if s.steps_since]
        for p in trained:
            if not (waits and self.under_way(p)):
                self.held.discard(p)
                self.launch(params, p)
        return not trained and self.outbox.unsent() == 0, params

    def flush(self, params: Params, final: bool) -> Params:
        """Pushes every fragment's steps since its last push, held or not; waits for delivery.

        Undelivered pushes are given up after 2 × `rpc_timeout_s` (`pushes_unsent`). The run's
        final flush first lets round trips under way end (`end_trips`).

        Returns:
          The parameters pushed (with the merges that came back meanwhile applied).
        """
        if final and self.bridge.alone:
            params = self.end_trips(params)
        self.drop_covered(params)
        for p, state in enumerate(self.states):
            if state.steps_since:
                self.held.discard(p)
                self.launch(params, p, final=final)
        deadline = time.monotonic() + 2 * self.config.decoupled.syncer.rpc_timeout_s
        while self.outbox.unsent() and time.monotonic() < deadline and not self.stop.wait(0.02):
            pass
        return params

    def end_trips(self, params: Params) -> Params:
        """Waits for the round trips under way of fragments with steps to push; applies merges.

        As a pause does, for `rpc_timeout_s` at most: pushed before its trip's merge is back, a
        fragment's final push would be anchored a round trip back, its outer gradient holding
        the steps of the push under way again (counted twice where that one is merged).
        """
        deadline = time.monotonic() + self.config.decoupled.syncer.rpc_timeout_s
        while True:
            params = self.apply_all(params)
            waiting = [p for p, s in enumerate(self.states) if s.steps_since and self.under_way(p)]
            if not waiting or time.monotonic() > deadline or self.stop.wait(0.02):
                return params

    def apply_all(self, params: Params) -> Params:
        """Applies every merge back in the inbox now, due or not; the parameters after them."""
        if self.inbox.waiting():
            params = self.merge(params, self.inbox.take_ready(sys.maxsize))
        return params

    def crossing(self, p: int) -> bool:
        """Whether fragment p's last push is unanswered, or refused as late with its trip on."""
        trip, job = self.trips.get(p), self.jobs.get(p)
        if trip is None or trip.done() or job is None:
            return False
        return job.answered_late is not False

    def close(self) -> None:
        """Stops starting round trips; those under way end as the link's `stop` makes them."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    # On a worker thread ------------------------------------------------------------------------

    def _sync(self, job: Outgoing) -> None:
        """One fragment's round trip (`_trip`); then the job lets go of its arrays.

        `jobs` keeps each fragment's last job until its next push (`crossing` reads its answer):
        holding θ's host copy and the anchor it was taken against, every fragment's would keep
        2x the model alive beside θ and the anchor. A process that does not talk to the syncer
        (a multi-process island's follower) settles its outbox entry at once.
        """
        try:
            if self.bridge.talks:
                self._trip(job)
            elif job.ticket is not None:
                self.outbox.deliver(job.ticket, lambda: None, self.stop)
        finally:
            job.release()
            # What the trip's buffers freed goes back to the OS now, not at some later trip
            # (glibc keeps fragment-sized buffers in its arenas: ~0.4 GB a trip at 350M).
            runtime.trim_memory()

    def _trip(self, job: Outgoing) -> None:
        """One fragment's round trip (`round_trip`) and its outcome; the merge goes to the inbox.

        The merged fragment is due at the step boundary after step `pushed_at` + τ, or at the
        first boundary after it arrives if it comes later.
        """
        p, state, counters = job.fragment, self.states[job.fragment], self.counters
        try:
            trip = round_trip(
                self.client,
                self.id,
                job,
                self.partition[p],
                self.encoder.codec,
                self.stop,
                # A newer push of p takes over the wait for a merge (one waiting pull each).
                still_current=lambda: state.awaited == job.round,
                wait_s=min(self.config.decoupled.syncer.rpc_timeout_s, 5.0),
                outbox=self.outbox,
                on_retry=counters.retried,
                merge_wait_s=self.config.decoupled.syncer.rpc_timeout_s,
            )
        except Exception as error:  # noqa: BLE001 - the step loop must go on; report it.
            if self.stop.is_set():  # gave up at the end: counted in `pushes_unsent`
                return
            message = f"fragment {p} round {job.round}: {type(error).__name__}: {error}"
            counters.errors.append(message)
            print(f"[learner {self.id}] sync error: {message}", file=sys.stderr, flush=True)
            return
        if trip is None:  # folded into a newer push, dropped, or the learner is stopping
            return
        counters.pushes[trip.outcome] += 1
        self.on_trip(trip)
        if trip.outcome == "covered":  # (its merge holds none of it: nothing to apply)
            # Restarting the count takes every process of an island at the same step: only an
            # island of one does it (else such a push's steps can reach the global model in
            # the next push of p; the ledger cannot see it).
            if self.bridge.alone:
                state.covered = True
            return
        if job.final:
            return
        counters.round_log.append(
            dict(
                fragment=p,
                round=job.round,
                step=job.pushed_at,
                sent=trip.sent,
                received=trip.received,
            )
        )
        if trip.version >= 0:
            late = None
            if job.answered_late and self.bridge.alone:
                # Its work is not lost: applied on top of the current values, it goes with the
                # next push (on data leases its batches would otherwise be handed out again, and
                # behind a slow link come back late again).
                reference = job.anchor if job.origin is None else job.origin
                data = list(job.ticket.data if job.ticket else job.data)
                late = Late(job.steps, job.tokens, data, reference)
            due = due_at(self.config, job.pushed_at)
            self.inbox.put(p, Inbound(trip.version, trip.values, due, job.pushed_at, late))


def due_at(config: ExperimentConfig, pushed_at: int) -> int:
    """The step after which a merge answering a push made after `pushed_at` is applied."""
    d = config.decoupled
    return pushed_at + (0 if d.apply_on_arrival else overlap_steps(config))
