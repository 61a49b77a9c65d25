"""One push of a link: functions of a `DecoupledSync`, on its step loop and its worker threads.

`push_due` runs on the step loop after each step: the fragments due (`learner.schedule`) are
launched, except one whose last round trip is still under way, which is held until it ends
(`under_way`); `flush` pushes what every fragment trained since, held or not.
`launch` runs on the step loop when fragment p is pushed: it takes the
fragment's host copy (or its encoding on the mesh, `learner.encoder`) before the next step
donates the buffers, records the push in the outbox and hands it to a worker thread, which
runs the link's `_sync` hook. `sync` is that hook's body: the round trip (`round_trip`) and
what its outcome changes on the link (push counters, the round's bytes, a refusal as covered);
the merged values go to the inbox, due at the step `due_at` says (with `wait_for_merge` the
step loop waits there for them: `wait_for_due_merges`). The link's state stays on
the link (`syncer.elastic` holds functions of a `SyncerState` the same way).
"""

from __future__ import annotations

import sys
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

import jax

from decoupled_diloco import runtime
from decoupled_diloco.config import ExperimentConfig, overlap_steps
from decoupled_diloco.core import fragments as F
from decoupled_diloco.learner import mesh_merge
from decoupled_diloco.learner.round_trip import Inbound, Late, Outgoing, round_trip

if TYPE_CHECKING:
    from decoupled_diloco.learner.link import DecoupledSync


def launch(link: DecoupledSync, params: Any, p: int, final: bool = False) -> None:
    """Hands fragment p's push to a worker thread (its host copy or encoding made here)."""
    leaves = F.gather(link.treedef.flatten_up_to(params), link.cut[p])
    # Steps run ahead asynchronously: wait for them outside the timer, so that it measures
    # the copy itself and not the compute it would otherwise absorb.
    jax.block_until_ready(leaves)
    t0 = time.perf_counter()
    if not final:
        link.last_push[p] = link.step
    source = leaves
    if link.config.decoupled.keep_overlap and not final:
        # A device copy: the next step donates these buffers.
        link.at_push[p] = mesh_merge.device_copy(leaves)
        if link.host_is_device:
            # On CPU `device_get` copies nothing: a view of the parameters would keep the next
            # step from donating them (it would allocate the fragment again). A view of the
            # overlap copy, kept until the merge anyway, costs nothing. (On an accelerator
            # the host copy would be cached on it for as long: the parameters' is not.)
            source = link.at_push[p]
    # Δ = reference − θ: from the anchor, or from θ where a lease handed again was covered.
    reference = link.anchor[p] if link.origin[p] is None else link.origin[p]
    if link.encoder.enabled:
        local = link.encoder.encode(p, reference, leaves)
        link.compress_s += time.perf_counter() - t0
    else:
        # θ on the host now (a copy, or on CPU a view): the next step donates the parameters.
        local = link._to_host(source)
    link.sync_host_s += time.perf_counter() - t0
    # Undelivered older pushes of p may be folded into this one (`Outbox`).
    ticket = link.outbox.add(
        p,
        link.versions[p],
        link.steps_since[p],
        link.tokens_since[p],
        not link.encoder.enabled,
        link.data_since[p],
    )
    job = Outgoing(
        p, link.rounds[p], link.versions[p], link.anchor[p], local,
        ticket.steps, ticket.tokens, final, link.step, ticket, origin=link.origin[p],
    )  # fmt: skip
    # The round moves on before the job starts; `sync` checks `waits` to know whether a newer
    # push of p has taken over the wait for a merge (a final push waits for none: a learner
    # flushing between leases still takes the merge of its last push as its new anchor).
    link.rounds[p] += 1
    if not final:
        link.waits[p] = job.round
    trip = link.pool.submit(link._sync, job)
    if not final:  # (a final push brings back no merge)
        link.trips[p], link.jobs[p] = trip, job
    link.steps_since[p] = link.tokens_since[p] = 0
    link.data_since[p] = []


def sync(link: DecoupledSync, job: Outgoing) -> None:
    """Background: one fragment's round trip (`_trip`); then the job lets go of its arrays.

    `link.jobs` keeps each fragment's last job until its next push (`crossing` reads its
    answer): holding θ's host copy and the anchor it was taken against, every fragment's
    would keep 2x the model alive beside θ and the anchor (a 1B learner was killed for
    memory at 15.3 GB, 3.7x its model; a 350M one grew by ~1 GB with each round trip).
    """
    try:
        _trip(link, job)
    finally:
        job.release()
        # What the trip's buffers freed goes back to the OS now, not at some later trip: a
        # synthetic 350M learner (4 fragments of 365 MB) otherwise kept ~0.4 GB more after each
        # trip in glibc's arenas (1.3 GB after four; peak 3.42x the model, 3.01x trimmed here).
        runtime.trim_memory()


def _trip(link: DecoupledSync, job: Outgoing) -> None:
    """One fragment's round trip (`round_trip`) and its outcome; the merge goes to the inbox.

    The merged fragment is due at the step boundary after step `pushed_at` + τ, or at the
    first boundary after it arrives if it comes later.
    """
    p = job.fragment
    try:
        trip = round_trip(
            link.client,
            link.id,
            job,
            link.cut[p],
            link.encoder.codec,
            link.stop,
            # A newer push of p takes over the wait for a merge (one waiting pull each).
            still_current=lambda: link.waits[p] == job.round,
            wait_s=min(link.config.decoupled.syncer.rpc_timeout_s, 5.0),
            outbox=link.outbox,
            on_retry=link._retried,
            merge_wait_s=link.config.decoupled.syncer.rpc_timeout_s,
        )
    except Exception as error:  # noqa: BLE001 - the step loop must go on; report it.
        if link.stop.is_set():  # gave up at the end: counted in `pushes_unsent`
            return
        link.errors.append(f"fragment {p} round {job.round}: {type(error).__name__}: {error}")
        print(f"[learner {link.id}] sync error: {link.errors[-1]}", file=sys.stderr, flush=True)
        return
    if trip is None:  # folded into a newer push, dropped, or the learner is stopping
        return
    link.pushes[trip.outcome] += 1
    if link.on_trip is not None:
        link.on_trip(trip)
    if trip.outcome == "covered":  # (its merge holds none of it: nothing to apply)
        link._on_covered(p)
        return
    if job.final:
        return
    link.round_log.append(
        dict(
            fragment=p,
            round=job.round,
            step=job.pushed_at,
            sent=trip.sent,
            received=trip.received,
        )
    )
    if trip.version >= 0:
        due = due_at(link.config, job.pushed_at)
        late = None
        if job.answered_late and link.rebases:
            # Its work is not lost: applied on top of the current values, it goes with the
            # next push (on data leases its batches would otherwise be handed out again, and
            # behind a slow link come back late again).
            reference = job.anchor if job.origin is None else job.origin
            late = Late(job.steps, job.tokens, list(job.ticket.data if job.ticket else job.data),
                        reference)  # fmt: skip
        link.inbox.put(p, Inbound(trip.version, trip.values, due, job.pushed_at, late))


def push_due(link: DecoupledSync, params: Any, due: list[int]) -> None:
    """After a step: pushes the fragments `due` now and those held, unless under way.

    A fragment due while its last round trip is still under way (a link behind the schedule)
    is held, not queued (`under_way`): pushed with every step since once the trip ends.
    """
    for p in sorted(set(due) | link.held):
        if link._under_way(p):
            link.deferred += p not in link.held
            link.held.add(p)
        else:
            link.held.discard(p)
            if link.steps_since[p]:  # (none: a fragment skipping a lease's covered batches)
                link._launch(params, p)


def pause(link: DecoupledSync, params: Any) -> bool:
    """One poll of a leased learner's wait for a lease; whether all it trained is settled.

    A pause is a step boundary with no step after it soon. Once no push is crossing (not
    answered yet, or refused as late and its current values not back), every merge that came
    back is applied (the work of a push refused as late rebased: `rebase`) and what was trained
    since is pushed as ordinary pushes, whose merges come back as anchors; settled once none
    is left to push or crossing, so that the syncer hands the learner back none of the batches
    it still holds. Accepted pushes' merges are not waited for: their data is the syncer's.
    A fragment with steps to push whose round trip is still under way (its merge coming back)
    waits for it, as a due fragment is held (`push_due`): pushed at once, it would be anchored
    a round trip further back (its outer gradient holding the push under way's steps again),
    and behind a slow link such pushes at a learner's end passed `max_staleness` and cost a
    pull and a second push each (issue 22). For `rpc_timeout_s` from the pause's first poll:
    on a link far below what the run needs pulls can take many minutes (measured at the
    scaled 0.5 Gbit/s uncompressed), and then the fragment goes as it is.
    The link's next `apply_arrivals` returns the parameters the merges made. A multi-process
    island (no `rebases`: its processes push together) flushes once and waits for delivery.
    """
    if not link.rebases:
        if any(link.steps_since):
            flush(link, params, final=False)
        return link.outbox.unsent() == 0
    if link.paused_at is None:
        link.paused_at = time.monotonic()
    # (Crossing first: a trip puts its merge in the inbox before it ends.)
    if any(crossing(link, p) for p in range(len(link.cut))):
        return False
    params = apply_all(link, params)
    drop_covered(link, params)
    waits = time.monotonic() - link.paused_at < link.config.decoupled.syncer.rpc_timeout_s
    trained = [p for p in range(len(link.cut)) if link.steps_since[p]]
    pushed = [p for p in trained if not (waits and link._under_way(p))]
    for p in pushed:
        link.held.discard(p)
        link._launch(params, p)
    return not trained and link.outbox.unsent() == 0


def end_trips(link: DecoupledSync, params: Any) -> Any:
    """Waits for the round trips under way of fragments with steps to push; applies the merges.

    As a pause does (`pause`), for `rpc_timeout_s` at most: pushed before its trip's merge is
    back, a fragment's final push would be anchored a round trip back, its outer gradient
    holding the steps of the push under way again (counted twice where that one is merged).

    Returns:
      The parameters with the merges applied (the link's `_merge`).
    """
    deadline = time.monotonic() + link.config.decoupled.syncer.rpc_timeout_s
    while True:
        params = apply_all(link, params)
        waiting = [p for p in range(len(link.cut)) if link.steps_since[p] and link._under_way(p)]
        if not waiting or time.monotonic() > deadline or link.stop.wait(0.02):
            return params


def apply_all(link: DecoupledSync, params: Any) -> Any:
    """Applies every merge back in the inbox now, due or not; the parameters after them."""
    if link.inbox.waiting():
        ready = link.inbox.take_ready(sys.maxsize)
        params = link._initial = link._last = link._merge(params, ready)
    return params


def crossing(link: DecoupledSync, p: int) -> bool:
    """Whether fragment p's last push is unanswered, or refused as late with its trip on."""
    trip, job = link.trips.get(p), link.jobs.get(p)
    if trip is None or trip.done() or job is None:
        return False
    return job.answered_late is not False


def flush(link: DecoupledSync, params: Any, final: bool) -> None:
    """Pushes every fragment's steps since its last push, held or not; waits for delivery.

    Undelivered pushes are given up after 2 × `rpc_timeout_s` (`pushes_unsent`). The run's
    final flush first lets round trips under way end (`end_trips`).
    """
    if final and link.rebases:
        params = end_trips(link, params)
    drop_covered(link, params)
    for p in range(len(link.cut)):
        if link.steps_since[p]:
            link.held.discard(p)
            link._launch(params, p, final=final)
    deadline = time.monotonic() + 2 * link.config.decoupled.syncer.rpc_timeout_s
    while link.outbox.unsent() and time.monotonic() < deadline and not link.stop.wait(0.02):
        pass


def under_way(link: DecoupledSync, p: int) -> bool:
    """Fragment p's last push is not delivered, or its merge not back and applied yet.

    A fragment due then is held until the trip ends, and pushed with every step since: one
    round trip per fragment at a time. Pushing it anyway behind a link slower than the
    schedule would queue pushes that grow older while they wait, until the syncer refuses them
    as late (`max_staleness`) or the outbox drops them; on data leases their data is then
    handed out and trained again, behind the same link (issue 22's livelock). Held, the learner
    keeps stepping and the fragment syncs every max(H, its trip) steps, as
    `sim.bandwidth.sync_interval_steps` plans. A merge that is back but waiting in the inbox
    counts as under way: a push anchored before it would be overwritten when it is applied.
    (A trip stops starting pulls `rpc_timeout_s` after its push's reply: `round_trip`.)
    """
    trip = link.trips.get(p)
    if trip is not None and not trip.done():  # (read first: `sync` fills the inbox, then ends)
        return True
    return p in link.inbox.waiting()


def drop_covered(link: DecoupledSync, params: Any) -> None:
    """Fragments whose last push was refused as covered count from θ now (`restart_count`)."""
    for p in sorted(link.covered):
        link.covered.discard(p)
        restart_count(link, params, p)


def restart_count(link: DecoupledSync, params: Any, p: int) -> None:
    """Fragment p's outer gradient counts from θ now; what it counted since is dropped.

    After a push refused as "covered" the dropped steps' data is not in the global model from
    this learner: the ledger sees a hole, which is handed again (lost compute, not lost data).
    A push of p launched before the refusal came back is not recalled.
    """
    leaves = F.gather(link.treedef.flatten_up_to(params), link.cut[p])
    link.origin[p] = link._to_host(leaves)
    link.steps_since[p] = link.tokens_since[p] = 0
    link.data_since[p] = []


def rebasable(link: DecoupledSync, p: int, inbound: Inbound) -> bool:
    """Whether `inbound` answers p's latest push, refused as late, whose work can be rebased.

    Not when the count of p changed reference since (a lease handed again started: its
    covered steps are skipped, `origin` set): progress since the refused push's reference
    would then hold covered steps, or its claimed batches none. Its batches are then a hole,
    handed again.
    """
    late = inbound.late
    return (
        late is not None
        and inbound.pushed_at == link.last_push[p]
        and p not in link.skip
        and (link.origin[p] is None or link.origin[p] is late.reference)
    )


def rebase(link: DecoupledSync, p: int, late: Late) -> list[jax.Array]:
    """A push of p refused as late, its merge applied now: its counts and data go with the next.

    Returns what the current values are applied against (`merge_back`'s `at_push`): the
    refused push's reference, so that θ keeps all the progress since it and the next push's Δ
    (from the current values) holds the refused steps too. A compressed push's error-feedback
    residual of p is zeroed: it counted the refused push as sent (without `keep_unsent` the
    remainder it held from earlier pushes is lost with it; with it, θ holds that already).
    """
    steps, tokens, link.data_since[p] = rebased(late, link.data_since[p])
    link.steps_since[p] += steps
    link.tokens_since[p] += tokens
    link.rebased += 1
    link.encoder.forget(p)
    return [
        link._place(v, link.shardings[x.index])
        for x, v in zip(link.cut[p], late.reference, strict=True)
    ]


def rebased(late: Late, since: list[list[int]]) -> tuple[int, int, list[list[int]]]:
    """A late push's steps and tokens to count again, and its batches before `since`'s.

    Batches trained again since (handed back before the merge came) are counted once: the
    parts of the late push's ranges overlapping them are left out, with their share of its
    steps and tokens.
    """
    kept: list[list[int]] = []
    for lease, begin, end in late.data:
        pieces = [(begin, end)]
        for other, b, e in since:
            if other == lease:
                pieces = [
                    (x, y)
                    for lo, hi in pieces
                    for x, y in ((lo, min(hi, b)), (max(lo, e), hi))
                    if x < y
                ]
        kept += [[lease, x, y] for x, y in pieces]
    total = sum(e - b for _, b, e in late.data)
    share = sum(e - b for _, b, e in kept) / total if total else 1.0
    ranges: list[list[int]] = []
    for lease, begin, end in kept + since:
        if ranges and ranges[-1][0] == lease and ranges[-1][2] == begin:
            ranges[-1][2] = end
        else:
            ranges.append([lease, begin, end])
    return round(late.steps * share), round(late.tokens * share), ranges


def wait_for_due_merges(link: DecoupledSync) -> None:
    """`wait_for_merge`: waits for each round trip whose merge is due by now to end.

    A round trip ends once its merge is in the inbox (or without one: a push folded into a
    newer one, refused as covered, or the link stopping).
    """
    for p, trip in list(link.trips.items()):
        if due_at(link.config, link.last_push[p]) <= link.step:
            while not trip.done() and not link.stop.is_set():
                futures.wait([trip], timeout=1.0)


def due_at(config: ExperimentConfig, pushed_at: int) -> int:
    """The step after which a merge answering a push made after `pushed_at` is applied."""
    d = config.decoupled
    return pushed_at + (0 if d.apply_on_arrival else overlap_steps(config))
