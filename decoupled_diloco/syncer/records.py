"""What the syncer records: a validated push, its answer, a learner's progress; timing rules.

Plain data and small pure functions, shared by the state, its write-ahead log and snapshots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from decoupled_diloco.core import accumulate


def grace_window(
    step_s: float, quorum_s: float, sync_s: float, overlap_steps: int, safety: float, cap_s: float
) -> float:
    """Eq. 3: ξ_grace = γ·(τ·ξ_step − ξ_quorum − ξ_sync), clipped to [0, cap_s].

    The learner has τ steps of slack before it wants the fragment back; quorum and the return
    trip use part of it, and a share γ of the rest is spent waiting for more learners.
    """
    return float(min(max(safety * (overlap_steps * step_s - quorum_s - sync_s), 0.0), cap_s))


class Ema:
    """Exponential moving average; the first sample sets the value."""

    def __init__(self, decay: float):
        self.decay, self.value = decay, None

    def update(self, x: float) -> None:
        """Folds in one sample."""
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x

    def get(self) -> float:
        """The average so far (0 before any sample)."""
        return 0.0 if self.value is None else float(self.value)


@dataclasses.dataclass
class Push:
    """One validated push: the learner's outer gradient of one fragment and its counters.

    `delta` is a `syncer.payloads.Payload` (the server's: the bytes as received, stored), or a
    list of arrays, one per tensor of the fragment (in-process callers and tests).
    """

    learner_id: int
    fragment: int
    round: int
    base_version: int
    steps: int
    tokens: int
    delta: Any
    incarnation: int = 0  # of the registration that sent it (`SyncerState.register`)
    data: list[list[int]] = dataclasses.field(default_factory=list)  # [lease, begin, end)s


@dataclasses.dataclass
class Pending:
    """A learner's push waiting in its fragment's open round.

    Attributes:
      parts: (base version, payload) of the outer gradients it holds: one, or (anchored at
        different versions, with `stale_anchor="learner"`) several whose progress adds up.
      weight: its token weight (tokens²/steps of all parts together).
      coef: its coefficient in the round's sums (`core.accumulate.RoundSum`), relative to the
        round's first weight; 0: not folded (held back, added when the round closes).
      data: the leased batches its outer gradients trained on (`syncer.ledger`).
    """

    learner_id: int
    round: int
    base_version: int
    steps: int
    tokens: int
    incarnation: int
    parts: list[tuple[int, Any]]
    weight: float
    coef: float = 0.0
    data: list[list[int]] = dataclasses.field(default_factory=list)  # leased batches it holds

    def describe(self) -> dict[str, Any]:
        """What the write-ahead log and snapshots record of it (JSON)."""
        entry = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("parts", "coef")}
        entry["parts"] = [[base, payload.describe()] for base, payload in self.parts]
        return entry


@dataclasses.dataclass
class PushResult:
    """The answer to a push (mirrors `PushReply`)."""

    accepted: bool
    duplicate: bool = False
    reason: str = ""
    version: int = 0


# A learner's pace as the syncer sees it is measured over windows of at least this long.
PACE_WINDOW_S = 10.0


@dataclasses.dataclass
class LearnerInfo:
    """What the syncer knows about one learner."""

    mesh: str = ""
    step: int = 0
    tokens: int = 0
    loss: float = float("nan")
    eval_loss: float = float("nan")
    state: str = "registered"
    last_seen: float = 0.0  # its last heartbeat, registration, lease request or push
    # Its last push chunk: behind a saturated slow uplink, heartbeats wait behind the push
    # data (measured: over 30 s at 0.136 Mbit/s) while the chunks show the learner alive.
    last_chunk: float = 0.0
    versions: list[int] = dataclasses.field(default_factory=list)
    blocked_s: float = 0.0
    step_time_s: float = 0.0
    phase_step: int = 0  # the step its pushes are scheduled by (`Schedule.align`)
    pushes: int = 0
    bytes_sent: int = 0  # the learner's data-call traffic so far (its heartbeat's counters)
    bytes_received: int = 0
    sync_rounds: int = 0
    incarnation: int = -1  # of its last registration (0 for the first); older pushes refused
    dropped_pushes: int = (
        0  # accepted pushes whose merge was refused (`SyncerState.merge_fragment`)
    )
    # The syncer's own view of its pace: (step, time) where the current window began, and the
    # wall time per step it saw over the last full window (`observe_pace`).
    pace_from: tuple[int, float] | None = None
    seen_step_s: float = 0.0

    def observe_pace(self, now: float) -> None:
        """Updates the wall time per step the syncer saw, over windows of `PACE_WINDOW_S`."""
        if self.pace_from is None or self.step < self.pace_from[0]:
            self.pace_from = (self.step, now)
            return
        step0, t0 = self.pace_from
        if now - t0 >= PACE_WINDOW_S and self.step > step0:
            self.seen_step_s = (now - t0) / (self.step - step0)
            self.pace_from = (self.step, now)

    def dylu_step_time(self) -> float:
        """The step time DyLU counts: the claim, floored at half the pace the syncer saw."""
        return max(self.step_time_s, self.seen_step_s / 2) if self.step_time_s > 0 else 0.0


class FragmentState:
    """Global values, outer optimizer state, version and the open round of one fragment.

    Args:
      specs: the fragment's tensor specs.
      flat: its global values as one float32 vector (its own copy: merges never share it);
        `values` are views of it, one per tensor. Never written once installed: a merge
        installs a new vector (`set_flat`), so snapshots and pulls may hold the old one.
      opt_state: the outer optimizer's state for it (`core.accumulate.FlatStep`'s leaves).
    """

    def __init__(self, specs: list[Any], flat: np.ndarray, opt_state: list[Any]):
        self.specs, self.opt_state = specs, opt_state
        self.set_flat(flat)
        self.version = 0
        # What learners may see (pull, register, heartbeat, status): with a durable syncer, a
        # merged version is published only once a checkpoint holding it is on disk.
        self.published, self.published_values = 0, self.values
        # version -> {tensor index: values}: what re-anchoring stale pushes needs (all tensors
        # with stale_anchor="syncer", else only the averaged ones; nothing if none).
        self.history: dict[int, dict[int, np.ndarray]] = {}
        self.pending: dict[int, Pending] = {}
        self.round: Any = None  # `core.accumulate.RoundSum` of the open round, if any
        self.first_weight = 0.0  # the open round's first token weight (coefficients' unit)
        self.first_push_t = self.quorum_t = self.closed_t = None
        # version -> learners whose pushes it merged and that have not pulled it yet: only
        # their pulls are return trips (ξ_sync); anyone else's pull of it is just catching up.
        self.awaiting_sync: dict[int, set[int]] = {}
        self.grace_s = 0.0
        self.merges = self.late = self.duplicates = self.refused_merges = 0
        self.accepted = 0  # pushes taken into a round (since this process started)

    def set_flat(self, flat: np.ndarray, norm: float | None = None) -> None:
        """Installs new global values (`values` become views of `flat`).

        `norm`: ‖flat‖ where known (a merge's, or a snapshot's record of it, so that a merge
        replayed after a restart meets the bounds it met when it ran); else computed here
        (float64 sums of chunks, as accurate as the merge's).
        """
        self._norm = accumulate.norm(flat) if norm is None else norm
        self.flat = flat
        if flat.size == 0:  # a fragment another shard owns: no values
            self.values = [flat] * len(self.specs)
            return
        values, at = [], 0
        for s in self.specs:
            n = math.prod(s.shape)
            values.append(flat[at : at + n].reshape(s.shape))
            at += n
        self.values = values  # one assignment: readers outside the lock see old or new

    def install(
        self,
        flat: np.ndarray,
        norm: float,
        kept: Any,
        learners: list[int],
        max_staleness: int,
        publish: bool,
    ) -> None:
        """Installs a merged version: new values, the version history, who awaits it.

        Args:
          flat: the merged values (`FlatStep`'s new vector).
          norm: ‖flat‖, computed with it (`norm`).
          kept: what the history keeps of a version's values (`FragmentMath.kept`).
          learners: the learners whose pushes it merged.
          max_staleness: versions older than this many behind are forgotten.
          publish: make it visible at once (a syncer without durability).
        """
        self.set_flat(flat, norm)
        self.round = None
        self.version += 1
        if publish:
            self.published, self.published_values = self.version, self.values
        self.merges += 1
        history = kept(self.values)
        if history:
            self.history[self.version] = history
        self.awaiting_sync[self.version] = set(learners)
        oldest = self.version - max_staleness
        self.history = {v: x for v, x in self.history.items() if v >= oldest}
        self.awaiting_sync = {v: x for v, x in self.awaiting_sync.items() if v >= oldest}

    def norm(self) -> float:
        """‖Θ‖ of the installed values, the scale of the admission bounds (`syncer.admission`).

        Computed once per installed vector, by the merge that made it or by `set_flat`; a
        reader outside the lock gets the norm of a vector that was installed.
        """
        return self._norm

    def end_round(self) -> None:
        """Forgets the open round (merged or dropped)."""
        self.pending, self.first_push_t, self.quorum_t, self.round = {}, None, None, None
