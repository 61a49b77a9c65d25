"""What the syncer records: a validated push, its answer, a learner's progress; timing rules.

Plain data and small pure functions, shared by the state, its write-ahead log and snapshots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


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
    """One validated push: the learner's outer gradient of one fragment and its counters."""

    learner_id: int
    fragment: int
    round: int
    base_version: int
    steps: int
    tokens: int
    delta: list[np.ndarray]
    incarnation: int = 0  # of the registration that sent it (`SyncerState.register`)


@dataclasses.dataclass
class PushResult:
    """The answer to a push (mirrors `PushReply`)."""

    accepted: bool
    duplicate: bool = False
    reason: str = ""
    version: int = 0


@dataclasses.dataclass
class LearnerInfo:
    """What the syncer knows about one learner."""

    mesh: str = ""
    step: int = 0
    tokens: int = 0
    loss: float = float("nan")
    eval_loss: float = float("nan")
    state: str = "registered"
    last_seen: float = 0.0
    versions: list[int] = dataclasses.field(default_factory=list)
    blocked_s: float = 0.0
    step_time_s: float = 0.0
    pushes: int = 0
    bytes_sent: int = 0  # the learner's data-call traffic so far (its heartbeat's counters)
    bytes_received: int = 0
    sync_rounds: int = 0
    incarnation: int = -1  # of its last registration (0 for the first); older pushes refused
    dropped_pushes: int = 0  # accepted pushes whose merge was refused (`SyncerState._merge`)


class FragmentState:
    """Global values, outer optimizer state, version and the open round of one fragment.

    Args:
      specs: the fragment's tensor specs.
      values: its global values (own copies: merges never share them).
      opt_state: the outer optimizer's state for them (host arrays).
    """

    def __init__(self, specs: list[Any], values: list[np.ndarray], opt_state: Any):
        self.specs, self.values, self.opt_state = specs, values, opt_state
        self.version = 0
        # What learners may see (pull, register, heartbeat, status): with a durable syncer, a
        # merged version is published only once a checkpoint holding it is on disk.
        self.published, self.published_values = 0, self.values
        self.history = {0: self.values}
        self.pending: dict[int, Push] = {}
        self.first_push_t = self.quorum_t = self.closed_t = None
        # version -> learners whose pushes it merged and that have not pulled it yet: only
        # their pulls are return trips (ξ_sync); anyone else's pull of it is just catching up.
        self.awaiting_sync: dict[int, set[int]] = {}
        self.grace_s = 0.0
        self.merges = self.late = self.duplicates = self.refused_merges = 0
