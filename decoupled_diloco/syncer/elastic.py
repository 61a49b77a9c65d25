"""The syncer's side of elastic membership: learners, data leases, who joined and left.

Functions of a `SyncerState` (its `learners`, `ledger`, `membership`), called under its lock
or taking it: `register` and `heartbeat` record a learner's (re)registration and progress
(the state's methods of those names call them), `live_learners`, `live_count`, `lead_step`
and `fastest_step_time` read them; `lease` hands a learner a lease (`syncer.ledger`),
`check_data` admits a push's data ranges, `log_membership` / `check_membership` record joins,
restarts, leaves (a learner that said done) and losses (silent past `learner_timeout_s`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from decoupled_diloco.config import ExperimentConfig, units_per_step
from decoupled_diloco.syncer import ledger as ledger_lib
from decoupled_diloco.syncer.records import Ema, FragmentState, LearnerInfo, PushResult

# Data ranges one push may carry (leases its outer gradient spans; each lease is one range).
MAX_DATA_RANGES = 256
# A lead's step is extrapolated from its last heartbeat by at most this many rounds (H steps).
EXTRAPOLATED_ROUNDS = 10
MEMBERSHIP_KEPT = 1000  # membership changes kept in memory (the status and snapshot: 200)


class Members(Protocol):
    """What these functions read and change of a syncer's state (`state.SyncerState`)."""

    config: ExperimentConfig
    clock: Callable[[], float]
    lock: threading.Condition  # guards everything below
    learners: dict[int, LearnerInfo]
    live_ids: set[int]  # the live set the membership log last saw
    membership: list[dict[str, Any]]
    ledger: ledger_lib.Ledger | None
    seen: dict[tuple[int, int, int], PushResult]  # pushes by idempotency key
    ema_step: Ema
    fragments: Sequence[FragmentState]

    def live_learners(self, now: float) -> list[int]:
        """Learners still training, heard from within the timeout."""

    def versions(self) -> list[int]:
        """Each fragment's published version."""

    def record_change(self, kind: str, *args: Any) -> None:
        """Writes a change to the write-ahead log (under the lock)."""


def live_learners(state: Members, now: float) -> list[int]:
    """Learners still training whose last message is within `learner_timeout_s`."""
    timeout = state.config.decoupled.syncer.learner_timeout_s
    return [
        i
        for i, info in state.learners.items()
        if info.state != "done" and now - max(info.last_seen, info.last_chunk) <= timeout
    ]


def live_count(state: Members) -> int:
    """How many learners are training now (`live_learners`): a constant global batch's split."""
    with state.lock:
        return len(state.live_learners(state.clock()))


def lead_step(state: Members, learner_id: int) -> tuple[float, float]:
    """The most advanced other live learner's phase step, extrapolated to now; its step time.

    From each live learner's last heartbeat: the step its pushes are scheduled by (its
    `phase_step`, its step where it sent none) plus the time since over its step time (the
    floored one, `LearnerInfo.dylu_step_time`: a learner claiming tiny steps cannot throw the
    extrapolation far; at most `EXTRAPOLATED_ROUNDS` rounds). A learner starting its
    loop takes this one's push phase (`Schedule.align`), so that pushes of the same round
    arrive together. (-1, 0) when no other learner has a step time yet.
    """
    inner_steps = state.config.inner_steps
    with state.lock:
        now = state.clock()
        best = (-1.0, 0.0)
        for i in state.live_learners(now):
            info = state.learners[i]
            step_s = info.dylu_step_time()
            if i == learner_id or step_s <= 0:
                continue
            ahead = min((now - info.last_seen) / step_s, EXTRAPOLATED_ROUNDS * inner_steps)
            at = (info.phase_step or info.step) + ahead
            best = max(best, (at, step_s))
        return best


def fastest_step_time(state: Members) -> float:
    """The shortest recent step time among live learners (0 when none reported yet).

    Each learner's is the larger of what it claims and half the pace the syncer saw in its
    heartbeats (`LearnerInfo.dylu_step_time`): a learner that claims tiny steps cannot
    shrink every other learner's H (DyLU) more than twofold below what it really does.
    """
    with state.lock:
        live = state.live_learners(state.clock())
        times = [state.learners[i].dylu_step_time() for i in live]
        return min((t for t in times if t > 0), default=0.0)


def register(state: Members, learner_id: int, mesh: str) -> tuple[list[int], int]:
    """Registers (or re-registers) a learner; returns the fragment versions, its incarnation."""
    with state.lock:
        info = state.learners.setdefault(learner_id, LearnerInfo())
        info.mesh, info.state, info.last_seen = mesh, "training", state.clock()
        info.pace_from, info.seen_step_s = None, 0.0  # a restart's pace starts again
        info.step_time_s = 0.0  # (nor is the old incarnation's step a lead to follow)
        info.incarnation += 1
        # A (re)registration is a new incarnation that numbers its rounds from 0 again:
        # forget the old one's idempotency keys, or its first pushes would look like retries.
        state.seen = {k: v for k, v in state.seen.items() if k[0] != learner_id}
        if state.ledger is not None:  # the old incarnation's leases are handed again
            state.ledger.release(learner_id)
        log_membership(state, "joined" if info.incarnation == 0 else "restarted", learner_id)
        state.record_change("register", learner_id)  # a restart must not resurrect old keys
        return state.versions(), info.incarnation


def heartbeat(state: Members, learner_id: int, /, **fields: Any) -> list[int]:
    """Records a learner's progress; returns the fragment versions.

    `state` and `learner_id` are positional only: `fields` holds the learner's own `state`.
    """
    with state.lock:
        info = state.learners.setdefault(learner_id, LearnerInfo())
        for name, value in fields.items():
            setattr(info, name, value)
        info.last_seen = state.clock()
        if learner_id not in state.live_ids and info.state == "training":
            log_membership(state, "back", learner_id)  # silent past the timeout, then heard
        info.observe_pace(info.last_seen)
        if info.step_time_s > 0:
            state.ema_step.update(info.dylu_step_time())
        state.lock.notify_all()  # a learner that finished may complete a quorum
        return state.versions()


def pending_ranges(state: Members) -> list[list[list[int]]]:
    """Per fragment, the data ranges of accepted pushes waiting in open rounds."""
    return [[r for x in f.pending.values() for r in x.data] for f in state.fragments]


def lease(state: Members, learner_id: int, flushed: bool) -> ledger_lib.Grant:
    """Hands a registered learner a lease of data not covered yet (`Ledger.grant`)."""
    with state.lock:
        if state.ledger is None:
            return ledger_lib.Grant("off")
        if learner_id in state.learners:  # asking is a sign of life, as a heartbeat is
            state.learners[learner_id].last_seen = state.clock()
        live = state.live_learners(state.clock())
        grant = state.ledger.grant(learner_id, live, flushed, pending_ranges(state))
        grant.live = len(live)
        if grant.status == "granted":
            state.record_change("lease", learner_id, grant.lease)
        return grant


def check_data(state: Members, learner_id: int, steps: int, data: list[list[int]]) -> str | None:
    """Why a push's data ranges are refused (None: none given, or they are sound).

    They must lie inside leases the learner was handed, and count its inner steps: one batch
    per step, or with a constant global batch between one unit per step and the most units
    one step can train (`config.units_per_step` with one learner live).
    """
    if not data:
        return None
    if state.ledger is None:
        return "data ranges given, but this run has no data leases (decoupled.data_shards)"
    with state.lock:
        error = state.ledger.check_ranges(learner_id, data, MAX_DATA_RANGES)
    units, most = sum(end - begin for _, begin, end in data), units_per_step(state.config, 1)
    if error is None and not steps <= units <= steps * most:
        error = f"data ranges hold {units} units, steps={steps} train {steps}..{steps * most}"
    return error


def log_membership(state: Members, event: str, learner_id: int) -> None:
    """Logs a change of the live set (call under the state's lock)."""
    live = set(state.live_learners(state.clock()))
    state.membership.append(
        {"time": round(time.time(), 3), "event": event, "learner": learner_id, "live": sorted(live)}
    )
    del state.membership[:-MEMBERSHIP_KEPT]  # bounded: a crash-looping learner cannot grow it
    state.live_ids = live


def check_membership(state: Members) -> None:
    """Logs learners that left the live set since the last call (call under the lock)."""
    live = set(state.live_learners(state.clock()))
    for i in sorted(state.live_ids - live):
        log_membership(state, "left" if state.learners[i].state == "done" else "lost", i)
    state.live_ids = live
