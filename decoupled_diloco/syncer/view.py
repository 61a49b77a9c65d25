"""The syncer's status: what `Status` replies with and `python -m decoupled_diloco.status` shows."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from decoupled_diloco.syncer import elastic


def status(state: Any) -> dict[str, Any]:
    """Learners (progress, heartbeat age, staleness), fragments (versions, merges), EMAs.

    Args:
      state: the `SyncerState`; bounded in size (heartbeats are checked). Only shallow copies are
        taken under its lock (a heartbeat replaces a learner's fields, never mutates them); the
        learners' records are expanded after it is released.
    """
    with state.lock:
        now = state.clock()
        versions = state.versions()
        infos = [(i, copy.copy(info)) for i, info in sorted(state.learners.items())]
        reply = {
            "live": state.live_learners(now),
            "fragments": [
                {
                    "version": f.published,
                    "owned": p in state.owned,
                    "merges": f.merges,
                    "pending": sorted(f.pending),
                    "accepted_pushes": f.accepted,
                    "late_pushes": f.late,
                    "refused_merges": f.refused_merges,
                    "duplicate_pushes": f.duplicates,
                    "bytes": sum(s.nbytes for s in f.specs),
                    "grace_s": f.grace_s,
                }
                for p, f in enumerate(state.fragments)
            ],
            "merges": sum(f.merges for f in state.fragments),
            "uptime_s": now - state.started,
            "merge_sizes": list(state.merge_sizes),
            "ema": {
                "step_s": state.ema_step.get(),
                "quorum_s": state.ema_quorum.get(),
                "sync_s": state.ema_sync.get(),
            },
            "merge_log": state.merge_log[-200:],
            "membership": state.membership[-200:],
            "data_ledger": None
            if state.ledger is None
            else state.ledger.report(elastic.pending_ranges(state)),
        }
    learners = {}
    for i, info in infos:
        entry = dataclasses.asdict(info)
        entry["heartbeat_age_s"] = now - info.last_seen
        entry["staleness"] = max(
            (v - h for v, h in zip(versions, info.versions, strict=False)), default=0
        )
        entry.pop("last_seen")
        entry.pop("last_chunk")
        learners[str(i)] = entry
    return {"learners": learners, **reply}
