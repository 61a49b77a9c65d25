"""Merged fragments that have arrived from the syncer and wait for their step boundary.

A worker thread leaves each merge here (`put`); the step loop takes those whose overlap has
passed (`take_ready`) at a step boundary. The same version may answer two pushes (the newer one
superseded the older in the syncer's open round): it then answers the newer one, and a merge
answering an older push never replaces one answering a newer.
"""

from __future__ import annotations

import threading

from decoupled_diloco.learner.round_trip import Inbound


class Inbox:
    """At most one waiting merge per fragment; safe to use from several threads."""

    def __init__(self):
        self._held: dict[int, Inbound] = {}
        self._lock = threading.Lock()

    def put(self, p: int, inbound: Inbound) -> None:
        """Leaves fragment p's merge (unless a newer one for p is already waiting)."""
        with self._lock:
            held = self._held.get(p)
            newer = (inbound.version, inbound.pushed_at)
            if held is None or (held.version, held.pushed_at) < newer:
                self._held[p] = inbound

    def take_ready(self, step: int) -> dict[int, Inbound]:
        """Removes and returns the merges due after `step` (their `apply_after_step`)."""
        with self._lock:
            ready = {p: x for p, x in self._held.items() if step >= x.apply_after_step}
            for p in ready:
                del self._held[p]
        return ready

    def waiting(self) -> dict[int, int]:
        """Fragment -> version of every merge still waiting for its step."""
        with self._lock:
            return {p: x.version for p, x in self._held.items()}
