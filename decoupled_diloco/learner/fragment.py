"""One fragment's state on a learner's link: what it is anchored to, and what its next push holds.

A `DecoupledSync` keeps one `FragmentState` per fragment (`core.fragments.partition`). The step
loop counts each finished step into it (`count`); a push takes the counts (`take_counts`) and
is anchored at `anchor`; the merge that answers it becomes the new anchor (`anchored`). The
outer gradient of a fragment is Δ = reference − θ, where the reference is its anchor, or `origin`
once the count restarted from θ (a lease handed again whose batches its pushes already hold, or
a push refused as covered). Pure bookkeeping: no devices, threads or network.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from decoupled_diloco.learner.round_trip import Inbound, Late


@dataclasses.dataclass
class FragmentState:
    """One fragment's anchor and the counts its next push carries.

    `steps_since`, `tokens_since` and `data_since` (the leased batches as [lease, begin, end)
    ranges, `syncer.ledger`) always describe the same steps: the steps since the reference.
    """

    anchor: list[np.ndarray] = dataclasses.field(default_factory=list)  # the global values
    version: int = 0  # of the anchor
    steps_since: int = 0
    tokens_since: int = 0
    data_since: list[list[int]] = dataclasses.field(default_factory=list)
    round: int = 0  # pushes launched
    awaited: int = -1  # the round of the push whose merge is awaited (a newer one takes over)
    last_push: int = -1  # the step of the last (non-final) push
    # Δ is taken from here (host θ at the restart) instead of the anchor until the next merge.
    origin: list[np.ndarray] | None = None
    # A lease handed again: (lease, position) up to which this fragment's pushes hold its
    # batches; its steps there are not counted, and after them the count restarts from θ.
    skip: tuple[int, int] | None = None
    covered: bool = False  # the last push was refused as covered: restart at the next step
    at_push: Any = None  # keep_overlap: a device copy of θ at the last push

    def count(self, tokens: int, ranges: list[list[int]]) -> None:
        """Counts one step of `tokens` tokens on the leased batches `ranges`."""
        self.steps_since += 1
        self.tokens_since += tokens
        since = self.data_since
        for lease, begin, end in ranges:
            if since and since[-1][0] == lease and since[-1][2] == begin:
                since[-1][2] = end
            else:
                since.append([lease, begin, end])

    def take_counts(self) -> tuple[int, int, list[list[int]]]:
        """The steps, tokens and batches since the reference, for a push; then zero."""
        counts = self.steps_since, self.tokens_since, self.data_since
        self.steps_since = self.tokens_since = 0
        self.data_since = []
        return counts

    def restart(self, origin: list[np.ndarray]) -> None:
        """Counts from `origin` (host θ now); what was counted since the reference is dropped."""
        self.origin = origin
        self.take_counts()

    def skipped(self, ranges: list[list[int]]) -> bool | None:
        """Whether a step on `ranges` is one of `skip`'s covered steps (not counted).

        Returns:
          None when it is not; True when it is and the covered position is reached by it (the
          count then restarts from θ after it: `restart`); False when covered steps remain.
        """
        if self.skip is None:
            return None
        lease, until = self.skip
        mine = [r for r in ranges if r[0] == lease]
        if not mine:
            return None
        if max(r[2] for r in mine) >= until:
            self.skip = None
            return True
        return False

    def anchored(self, inbound: Inbound) -> None:
        """The merge `inbound` is applied: it is the new anchor, and Δ counts from it."""
        self.anchor, self.version = inbound.values, inbound.version
        self.origin = None

    def rebasable(self, inbound: Inbound) -> bool:
        """Whether `inbound` answers the latest push, refused as late, whose work can be rebased.

        Not when the count changed reference since (a lease handed again started: its covered
        steps are skipped, `origin` set): progress since the refused push's reference would
        then hold covered steps, or its claimed batches none. Its batches are then a hole,
        handed again.
        """
        late = inbound.late
        return (
            late is not None
            and inbound.pushed_at == self.last_push
            and self.skip is None
            and (self.origin is None or self.origin is late.reference)
        )

    def rebase(self, late: Late) -> None:
        """A push refused as late, its merge applied now: its counts and data go with the next."""
        steps, tokens, self.data_since = rebased(late, self.data_since)
        self.steps_since += steps
        self.tokens_since += tokens


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
