"""The syncer's data ledger: the run's data as leases, and which of it the global model holds.

The run's token budget is `num_learners` · `train_steps` batches. It is cut into S leases
(`decoupled.data_shards`, fewer when the budget has fewer batches): lease k is the first
`length(k)` batches of the dataset's shard k of S (`Dataset.train_iterator(batch_size, k, S,
seed)`: the same seed gives the same data order per shard, whoever trains it). With a
constant global batch (`decoupled.global_batch`) the ledger's unit is `lease_unit` rows, not
a batch, and a step trains several units: "batch" below means one unit. A learner asks
for a lease (`grant`) when it starts and whenever it has trained its current one to the end;
every push it makes says which batches of which leases its outer gradient holds (`DataRange`s:
lease, first position, end), per fragment.

A batch is *consumed* by fragment p when a merge of p holds a push that trained on it (pushes
of a refused merge do not count: their rounds are dropped). Coverage counts accepted pushes
still waiting in an open round too (they will be merged, or refused and then handed again). A
lease's *start* is the first position some fragment does not cover yet: what is handed again
when its holder is gone (a learner that registered again, a learner silent past
`learner_timeout_s`, or the holder itself once it has flushed everything and a hole is left,
e.g. by a push refused as late). So a learner that dies loses the steps it trained since its
pushes, not their data: the next holder trains them again.

With P > 1 fragments, pushed on staggered schedules, a learner that dies has pushed some
fragments further into its lease than others; the next holder starts at the least covered
position, so the fragments that were further along see those batches twice (`repeated`, per
fragment, in `report`). With P = 1 nothing is lost or repeated.

Pure bookkeeping (no I/O, no locks): `SyncerState` owns one and calls it under its lock; its
state goes into the syncer's snapshots (`to_json`) and every grant into the write-ahead log.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

Range = Sequence[int]  # [lease, begin, end): batches begin..end-1 of one lease

# How many uncovered ranges `report` lists (it counts them all).
LISTED_RANGES = 20


@dataclasses.dataclass
class Grant:
    """The answer to a lease request (mirrors `LeaseReply`).

    Attributes:
      status: "granted" (train `lease` from `begin` to `end`), "wait" (none free now, but
        leases held by other live learners are not covered yet: one may be handed again, ask
        again after flushing), "done" (every batch of the budget is covered).
      lease: the lease (shard of the data) granted, else -1.
      begin: the first batch position to train.
      end: one past the last.
      num_shards: S, the shard count the data is cut into.
      covered: per fragment, how far its accepted pushes reach into the lease (>= `begin`):
        the learner trains from `begin` but pushes fragment p only what it trains after
        `covered[p]` (so no fragment sees a batch twice).
      live: learners training now (set by the syncer, `syncer.elastic.lease`).
    """

    status: str
    lease: int = -1
    begin: int = 0
    end: int = 0
    num_shards: int = 0
    covered: list[int] = dataclasses.field(default_factory=list)
    live: int = 0


def split(total_batches: int, shards: int) -> list[int]:
    """Batches per lease: `total_batches` over min(`shards`, `total_batches`) leases, evenly."""
    n = max(min(shards, total_batches), 1)
    return [total_batches // n + (k < total_batches % n) for k in range(n)]


def _first_gap(held: np.ndarray) -> tuple[int, int, list[int]]:
    """The first range of a lease to train again, and how far into it each fragment holds it.

    Args:
      held: (P, L) booleans, which of the lease's batches each fragment's pushes hold.

    Returns:
      (begin, end, covered): begin is the first batch some fragment lacks; in [begin, end)
      every fragment p holds exactly [begin, covered[p]) and lacks the rest, so a learner that
      trains the range and pushes fragment p only from covered[p] on gives every fragment
      each batch once.
    """
    length = held.shape[1]
    begin = int(np.flatnonzero(~held.all(axis=0))[0])

    def next_change(row: np.ndarray, start: int) -> int:
        changed = np.flatnonzero(row[start:] != row[start])
        return start + int(changed[0]) if len(changed) else length

    end, covered = length, []
    for row in held:
        c = next_change(row, begin) if row[begin] else begin  # the held prefix from begin
        end = min(end, next_change(row, c) if c < length else length)  # then the lacking run
        covered.append(c)
    return begin, end, [min(c, end) for c in covered]


class Ledger:
    """Leases of the run's data and their coverage by merged pushes (see the module doc).

    Args:
      total_batches: the run's budget in units (`config.budget_units`).
      shards: S requested (`decoupled.data_shards`).
      num_fragments: P.
      batch_size: windows (examples) per unit, for `report`.
      max_grants: a lease still not covered after it was handed this many times is given up
        rather than handed again (0: never): its missing windows are reported. Bounds the
        retraining of data whose pushes keep being refused (e.g. late, behind a link too slow
        for the push schedule), which would otherwise go on without end.
    """

    def __init__(
        self,
        total_batches: int,
        shards: int,
        num_fragments: int,
        batch_size: int,
        max_grants: int = 0,
    ):
        self.lengths = split(total_batches, shards)
        self.num_fragments, self.batch_size = num_fragments, batch_size
        self.max_grants = max_grants
        n = len(self.lengths)
        self.holder = [-1] * n  # learner id holding each lease (-1: none)
        self.grants = [0] * n  # times each lease was handed
        self.held_by: list[list[int]] = [[] for _ in range(n)]  # who was ever handed each
        # Per fragment: the ranges merged rounds of that fragment hold (in merge order).
        self.merged: list[list[list[int]]] = [[] for _ in range(num_fragments)]

    @property
    def num_shards(self) -> int:
        """S actually used (the budget may have fewer batches than `data_shards`)."""
        return len(self.lengths)

    def check_ranges(self, learner: int, ranges: Sequence[Range], max_ranges: int) -> str | None:
        """Why a push's data ranges are refused (None: well-formed, of leases `learner` held)."""
        if len(ranges) > max_ranges:
            return f"{len(ranges)} data ranges, more than {max_ranges}"
        for lease, begin, end in ranges:
            if not 0 <= lease < self.num_shards:
                return f"data range of lease {lease}, not in [0, {self.num_shards})"
            if learner not in self.held_by[lease]:
                return f"data range of lease {lease}, which learner {learner} was never handed"
            if not 0 <= begin < end <= self.lengths[lease]:
                return (
                    f"data range [{begin}, {end}) of lease {lease} is empty or outside its "
                    f"{self.lengths[lease]} batches"
                )
        spans = sorted((int(lease), int(begin), int(end)) for lease, begin, end in ranges)
        for (lease, _, end), (other, begin, _) in itertools.pairwise(spans):
            if lease == other and begin < end:  # one push would count these batches twice
                return f"data ranges overlap: [{begin}, {end}) of lease {lease} twice"
        return None

    def held(
        self, fragment: int, ranges: Sequence[Range], pending: Sequence[Range]
    ) -> Range | None:
        """The first of a push's `ranges` that `fragment` already holds (None: all new).

        A push that trained on data its fragment holds, merged or in `pending` (the ranges of
        the fragment's accepted pushes not merged yet), would put that data into the global
        model twice: a lease handed to another learner while its first holder was slow, not
        dead. Such a push is refused (`SyncerState.push`): nothing is ever repeated.
        """
        wanted: dict[int, list[tuple[int, int]]] = {}
        for lease, begin, end in ranges:
            wanted.setdefault(int(lease), []).append((int(begin), int(end)))
        for lease, begin, end in (*self.merged[fragment], *pending):
            for b, e in wanted.get(int(lease), ()):
                if begin < e and b < end:
                    return [int(lease), max(b, int(begin)), min(e, int(end))]
        return None

    def coverage(self, pending: Sequence[Sequence[Range]]) -> np.ndarray:
        """(P, total batches) booleans: which batches each fragment's pushes hold.

        Args:
          pending: per fragment, the ranges of its accepted pushes not merged yet (they count).
        """
        offsets = self.offsets()
        out = np.zeros((self.num_fragments, int(offsets[-1])), bool)
        for p in range(self.num_fragments):
            for lease, begin, end in (*self.merged[p], *(pending[p] if pending else ())):
                out[p, offsets[lease] + begin : offsets[lease] + end] = True
        return out

    def offsets(self) -> np.ndarray:
        """Where each lease starts in the budget's batches (and the total, last)."""
        return np.cumsum([0, *self.lengths])

    def release(self, learner: int) -> None:
        """Frees every lease `learner` holds (it registered again, or left for good)."""
        self.holder = [-1 if h == learner else h for h in self.holder]

    def grant(
        self,
        learner: int,
        live: Iterable[int],
        flushed: bool,
        pending: Sequence[Sequence[Range]],
    ) -> Grant:
        """Hands `learner` a lease whose data is not covered yet (see the module doc).

        Args:
          learner: who asks.
          live: the learners that count as alive (others' leases may be handed again).
          flushed: the asker has pushed everything it trained, so a hole left in a lease it
            holds can be handed back to it.
          pending: per fragment, the ranges of accepted pushes not merged yet.
        """
        live = set(live) | {learner}
        offsets, coverage = self.offsets(), self.coverage(pending)
        leases = [coverage[:, a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        open_ = [not seg.all() for seg in leases]  # some fragment lacks some batch
        # Open leases whose holder may still cover them, and those that could be handed.
        held = [
            open_[k] and not (h == -1 or h not in live or (h == learner and flushed))
            for k, h in enumerate(self.holder)
        ]
        free = [k for k in range(self.num_shards) if open_[k] and not held[k]]
        free = [k for k in free if not self.max_grants or self.grants[k] < self.max_grants]
        if not free:  # (leases handed `max_grants` times and not covered are given up)
            return Grant("wait" if any(held) else "done", num_shards=self.num_shards)
        # Leases handed before (a dead learner's tail) first: their data is the oldest.
        lease = min(free, key=lambda k: (self.grants[k] == 0, k))
        self.take(lease, learner)
        begin, end, covered = _first_gap(leases[lease])
        return Grant("granted", lease, begin, end, self.num_shards, covered)

    def take(self, lease: int, learner: int) -> None:
        """Records that `learner` holds `lease` (a grant, or its replay from the log)."""
        self.holder[lease] = learner
        self.grants[lease] += 1
        if learner not in self.held_by[lease]:
            self.held_by[lease].append(learner)

    def record_merge(self, fragment: int, ranges: Iterable[Range]) -> None:
        """A merge of `fragment` holds pushes that trained on `ranges`."""
        self.merged[fragment].extend([int(x) for x in r] for r in ranges)

    def report(self, pending: Sequence[Sequence[Range]] = ()) -> dict[str, Any]:
        """The data ledger in windows: consumed once, missing, repeated (`summary.json`).

        A batch counts as consumed once when every fragment's merges hold it exactly once;
        missing when some fragment's do not hold it (`pending`: the share of those that an
        accepted push not merged yet holds); repeated when some fragment's hold it twice or
        more. The first `LISTED_RANGES` missing ranges are listed with the fragments that
        lack them.
        """
        offsets = np.cumsum([0, *self.lengths])
        total = int(offsets[-1])
        counts = np.zeros((self.num_fragments, total), np.int32)
        waiting = np.zeros(total, bool)
        for p in range(self.num_fragments):
            for lease, begin, end in self.merged[p]:
                counts[p, offsets[lease] + begin : offsets[lease] + end] += 1
            for lease, begin, end in pending[p] if pending else ():
                waiting[offsets[lease] + begin : offsets[lease] + end] = True
        missing = (counts == 0).any(axis=0)
        repeated = (counts > 1).any(axis=0)
        once = (counts == 1).all(axis=0)
        listed = []
        for lease in range(self.num_shards):  # runs of missing batches, lease by lease
            lo = int(offsets[lease])
            row = missing[lo : offsets[lease + 1]].view(np.int8)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], row, [0]])))
            for a, b in zip(edges[::2], edges[1::2], strict=True):
                if len(listed) < LISTED_RANGES:
                    lacking = [
                        p
                        for p in range(self.num_fragments)
                        if (counts[p, lo + a : lo + b] == 0).any()
                    ]
                    listed.append(
                        {
                            "lease": lease,
                            "begin": int(a),
                            "end": int(b),
                            "fragments": lacking,
                            "holder": self.holder[lease],
                            "handed": self.grants[lease],
                        }
                    )
        b = self.batch_size
        return {
            "windows": total * b,
            "consumed_once": int(once.sum()) * b,
            "missing": int(missing.sum()) * b,
            "missing_pending": int((missing & waiting).sum()) * b,
            "repeated": int(repeated.sum()) * b,
            "leases": self.num_shards,
            "leases_handed_again": sum(max(g - 1, 0) for g in self.grants),
            # Leases given up with data missing, after `max_grants` grants (0: no bound).
            "leases_given_up": sum(
                1
                for k, g in enumerate(self.grants)
                if self.max_grants
                and g >= self.max_grants
                and (counts[:, offsets[k] : offsets[k + 1]] == 0).any()
            ),
            "missing_ranges": listed,
        }

    def to_json(self) -> dict[str, Any]:
        """The ledger's state for a snapshot: a copy, as of the call.

        A copy because the snapshot is written after the state lock is let go: with the lists
        themselves, a merge recorded meanwhile went into the snapshot too, and the write-ahead
        log's replay of that merge then counted its batches twice (`repeated`).
        """
        return copy.deepcopy(
            {
                "lengths": self.lengths,
                "holder": self.holder,
                "grants": self.grants,
                "held_by": self.held_by,
                "merged": self.merged,
            }
        )

    def load(self, saved: dict[str, Any]) -> None:
        """Takes back a snapshot's state (`to_json`).

        Raises:
          ValueError: it was cut for another budget or shard count.
        """
        if list(saved["lengths"]) != self.lengths or len(saved["merged"]) != self.num_fragments:
            raise ValueError(
                f"syncer checkpoint's data ledger has {len(saved['lengths'])} leases over "
                f"{sum(saved['lengths'])} batches and {len(saved['merged'])} fragments; this run "
                f"has {self.num_shards} over {sum(self.lengths)} and {self.num_fragments} "
                "(train_steps, num_learners, decoupled.data_shards or fragments changed?)"
            )
        self.holder = list(saved["holder"])
        self.grants = list(saved["grants"])
        self.held_by = [list(x) for x in saved["held_by"]]
        self.merged = [[list(r) for r in rs] for rs in saved["merged"]]
