"""When a merged version becomes visible, and the waits for it: functions of a `SyncerState`.

As `syncer.elastic`, these take the state (its `fragments`, `lock`, sequence numbers) and its
lock; the state's methods of the same names call them. `publish` makes merged versions
pullable once the change holding them is on disk (the committer, `syncer.durability`);
`wait_committed` holds a reply until its change is durable; `wait_for` holds a pull until its
fragment reaches a version; `record_sync_time` times ξ_sync after a pull delivered one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def publish(state: Any, seq: int, versions: dict[int, tuple[int, list[np.ndarray]]]) -> None:
    """Marks change `seq` durable and makes the given (version, values) visible.

    Called by the committer once a checkpoint holding them is on disk; versions only move
    forward.
    """
    with state.lock:
        if state.wal_failed and seq >= state.wal_failed_seq:
            return  # it holds a change the log does not
        for p, (version, values) in versions.items():
            frag = state.fragments[p]
            if version > frag.published:
                frag.published, frag.published_values = version, values
                frag.closed_t = state.clock()  # visible now: ξ_sync counts from here
        state.committed_seq = max(state.committed_seq, seq)
        state.lock.notify_all()


def wait_committed(state: Any, seq: int, timeout_s: float) -> bool:
    """Blocks until change `seq` is durable (at once when not `durable`); False on timeout."""
    deadline = state.clock() + timeout_s
    with state.lock:
        while state.durable and state.committed_seq < seq:
            left = deadline - state.clock()
            if left <= 0 or (state.wal_failed and seq >= state.wal_failed_seq):
                return False
            state.lock.wait(min(left, 0.05))
        return True


def wait_for(
    state: Any, p: int, min_version: int, timeout_s: float, alive: Callable[[], bool]
) -> tuple[int, list[np.ndarray]]:
    """Blocks until fragment p reaches `min_version` (or the timeout); returns its value.

    `alive` (the call still open) is checked while it waits: a caller that gave up does not
    keep a thread.
    """
    deadline = state.clock() + timeout_s
    with state.lock:
        frag = state.fragments[p]
        while frag.published < min_version:
            left = deadline - state.clock()
            if left <= 0 or not alive():
                return -1, []
            state.lock.wait(min(left, 0.05))
            state.maybe_close(p)
        return frag.published, frag.published_values


def record_sync_time(state: Any, p: int, version: int, learner_id: int) -> None:
    """After a pull delivered `version`: time since its round closed (ξ_sync).

    Counted once per learner whose push that merge holds: a learner that pulls a version
    merged without it (catching up, or the evaluator) did not wait for it, and the time
    since that close would inflate ξ_sync and shrink every later grace window to nothing.
    """
    with state.lock:
        frag = state.fragments[p]
        waiting = frag.awaiting_sync.get(version, set())
        if frag.published == version and frag.closed_t is not None and learner_id in waiting:
            waiting.discard(learner_id)
            state.ema_sync.update(state.clock() - frag.closed_t)
