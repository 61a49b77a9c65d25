"""When a learner pushes each fragment: the staggered schedule, H or DyLU's local H.

Fragment p is first due at its offset o_p (`core.fragments.offset`), then every H inner steps;
with dynamic local updates (DyLU) every ⌊H · t_fastest / t_own⌋ steps, so that a learner k
times slower than the fastest syncs as often in wall time. The step time is measured over
windows of steps (single steps are dispatched asynchronously and time nothing); the syncer's
grace window and DyLU use it.
"""

from __future__ import annotations

import math
import time

from decoupled_diloco.core import fragments

_STEP_WINDOW = 10  # steps per measurement of the step time


def reschedule(step: int, num_fragments: int, inner_steps: int) -> list[int]:
    """Each fragment's next due step after `step` on the staggered schedule."""
    due = []
    for p in range(num_fragments):
        first = fragments.offset(p, num_fragments, inner_steps)
        due.append(
            first if step < first else first + ((step - first) // inner_steps + 1) * inner_steps
        )
    return due


class Schedule:
    """The next due step of every fragment, and this learner's step time.

    Args:
      num_fragments: P.
      inner_steps: H.
      dynamic: dynamic local updates (DyLU) on.
    """

    def __init__(self, num_fragments: int, inner_steps: int, dynamic: bool = False):
        self.num_fragments, self.inner_steps, self.dynamic = num_fragments, inner_steps, dynamic
        self.next_due = reschedule(0, num_fragments, inner_steps)
        self.step_time_s = 0.0  # this learner's wall time per step (0 until measured)
        self.fastest_step_s = 0.0  # the fastest live learner's, as the syncer reports it
        # Steps its pushes are scheduled ahead of its own count (`align`; heartbeats report
        # step + shift as the phase other learners may align to).
        self.shift = 0
        # The most advanced other learner's phase step as last heard (step, perf_counter then,
        # its step time; `hear_lead`), and the step from which this learner takes its phase
        # (`resume(..., align=True)`; None: done, or off).
        self.lead: tuple[float, float, float] | None = None
        self._align_from: int | None = None
        self._window: tuple[int, float] | None = None  # (step, time) the window began

    def resume(self, step: int, align: bool = False) -> None:
        """The schedule from `step` on (a fresh start, or steps restored from a checkpoint).

        `align`: take the push phase of a learner ahead at the first step one is heard of
        (`align_if_due`; `decoupled.align_phase`).
        """
        self.next_due = reschedule(step, self.num_fragments, self.inner_steps)
        self.shift = 0
        self._align_from = step if align else None

    def hear_lead(self, lead: float, step_s: float) -> None:
        """The syncer's `lead_step` and that learner's step time (a heartbeat reply)."""
        self.lead = (lead, time.perf_counter(), step_s)

    def align_if_due(self, step: int) -> None:
        """Takes the push phase of a learner ahead, once, at the first step a lead is heard.

        Only a lead ahead of this learner's own phase is followed (two learners never take
        each other's). A lead of -1 (no other learner has a step time yet: a run's start, where
        all start together) ends it, as does a round without any answer (a syncer that does not
        say).
        """
        if self._align_from is None:
            return
        if self.lead is not None:
            lead, heard, step_s = self.lead
            if lead >= 0 and step_s > 0:
                lead += (time.perf_counter() - heard) / step_s
            if math.isfinite(lead) and lead > step + self.shift:
                self.align(step, lead)
            self._align_from = None
        elif step - self._align_from > self.inner_steps:
            self._align_from = None

    def align(self, step: int, lead: float) -> None:
        """Takes the push phase of a learner at step `lead` (this one being at `step`).

        Each fragment is next due when the other learner's would be, counted in this
        learner's steps: a learner that starts late (joins, restarts) then pushes each
        fragment with the others, in the same merges, instead of out of phase (where each
        group's merges would hold only its own pushes).
        """
        lead_at = int(round(lead))
        ahead = reschedule(lead_at, self.num_fragments, self.inner_steps)
        self.next_due = [step + at - lead_at for at in ahead]
        self.shift = lead_at - step

    def due(self, step: int) -> list[int]:
        """The fragments due after `step`; schedules each one's next push."""
        self.align_if_due(step)
        due = [p for p, at in enumerate(self.next_due) if step >= at]
        for p in due:
            self.next_due[p] = step + self.local_h()
        return due

    def local_h(self) -> int:
        """Inner steps until a pushed fragment is due again: H, or DyLU's (at least 1)."""
        H = self.inner_steps
        if not self.dynamic or self.fastest_step_s <= 0 or self.step_time_s <= 0:
            return H
        return max(1, int(H * min(self.fastest_step_s / self.step_time_s, 1.0)))

    def step_finished(self, step: int) -> None:
        """Counts inner step `step` as finished now (updates the step time once a window)."""
        now = time.perf_counter()
        if self._window is None:
            self._window = (step, now)
        elif step - self._window[0] >= _STEP_WINDOW:
            self.step_time_s = (now - self._window[1]) / (step - self._window[0])
            self._window = (step, now)
