"""The syncer's side of elastic membership: data leases and the log of who joined and left.

Functions of a `SyncerState` (its `ledger`, `learners`, `membership`), called under its lock
or taking it: `lease` hands a learner a lease (`syncer.ledger`), `check_data` admits a push's
data ranges, `log_membership` / `check_membership` record joins, restarts, leaves (a learner
that said done) and losses (silent past `learner_timeout_s`).
"""

from __future__ import annotations

import time
from typing import Any

from decoupled_diloco.syncer import ledger as ledger_lib

# Data ranges one push may carry (leases its outer gradient spans; each lease is one range).
MAX_DATA_RANGES = 256
MEMBERSHIP_KEPT = 1000  # membership changes kept in memory (the status and snapshot: 200)


def pending_ranges(state: Any) -> list[list[list[int]]]:
    """Per fragment, the data ranges of accepted pushes waiting in open rounds."""
    return [[r for x in f.pending.values() for r in x.data] for f in state.fragments]


def lease(state: Any, learner_id: int, flushed: bool) -> ledger_lib.Grant:
    """Hands a registered learner a lease of data not covered yet (`Ledger.grant`)."""
    with state.lock:
        if state.ledger is None:
            return ledger_lib.Grant("off")
        if learner_id in state.learners:  # asking is a sign of life, as a heartbeat is
            state.learners[learner_id].last_seen = state.clock()
        live = state.live_learners(state.clock())
        grant = state.ledger.grant(learner_id, live, flushed, pending_ranges(state))
        if grant.status == "granted":
            state._changed("lease", learner_id, grant.lease)
        return grant


def check_data(state: Any, learner_id: int, steps: int, data: list[list[int]]) -> str | None:
    """Why a push's data ranges are refused (None: none given, or they are sound).

    They must lie inside leases the learner was handed, and count its inner steps: one batch
    per step.
    """
    if not data:
        return None
    if state.ledger is None:
        return "data ranges given, but this run has no data leases (decoupled.data_shards)"
    with state.lock:
        error = state.ledger.check_ranges(learner_id, data, MAX_DATA_RANGES)
    if error is None and sum(end - begin for _, begin, end in data) != steps:
        error = f"data ranges hold {sum(e - b for _, b, e in data)} batches, steps={steps}"
    return error


def log_membership(state: Any, event: str, learner_id: int) -> None:
    """Logs a change of the live set (call under the state's lock)."""
    live = set(state.live_learners(state.clock()))
    state.membership.append(
        {"time": round(time.time(), 3), "event": event, "learner": learner_id, "live": sorted(live)}
    )
    del state.membership[:-MEMBERSHIP_KEPT]  # bounded: a crash-looping learner cannot grow it
    state._live = live


def check_membership(state: Any) -> None:
    """Logs learners that left the live set since the last call (call under the lock)."""
    live = set(state.live_learners(state.clock()))
    for i in sorted(state._live - live):
        log_membership(state, "left" if state.learners[i].state == "done" else "lost", i)
    state._live = live
