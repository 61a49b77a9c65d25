"""Plays a fault schedule (`chaos.Schedule`) against a run's processes.

The injector is a thread of the launcher: it fires each fault when it comes due (`at_s` after
the run's start, or when the learner's timeline reaches `at_step`), acts through a `Target` (the
`supervisor.Supervisor`), undoes pauses, slow-downs and link faults after their duration, and
logs every fault and recovery (and every join and leave, as a "membership" event: those are
changes of the fleet, not faults).
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from decoupled_diloco.chaos.faults import Fault, Schedule, write_controls


class Target(Protocol):
    """What the injector acts on (implemented by `supervisor.Supervisor`)."""

    def kill_learner(self, learner: int, repair_s: float) -> bool:
        """Kill -9 the learner's process; restart it after `repair_s`. False: not running."""

    def pause_learner(self, learner: int) -> bool:
        """SIGSTOP the learner's process. False: not running."""

    def resume_learner(self, learner: int) -> None:
        """SIGCONT a paused learner."""

    def kill_syncer(self, repair_s: float, shard: int = -1) -> bool:
        """Kill -9 the syncer (or one shard); restart it after `repair_s`. False: not running."""

    def learner_step(self, learner: int) -> int:
        """The learner's current step (-1 before its first)."""

    def join_learner(self, learner: int) -> bool:
        """Starts a new learner `learner` (a join). False: it is running already."""

    def leave_learner(self, learner: int) -> bool:
        """Ends `learner` gracefully for good (SIGTERM: a leave). False: not running."""


class Injector(threading.Thread):
    """Plays a schedule against a target; logs every fault and recovery through `log`.

    Args:
      schedule: the faults.
      target: the supervisor of the run's processes.
      control_dir: where learners' control files live.
      log: called with one event dict per injected fault or recovery.
      t0: the run's start (time.monotonic()); `at_s` counts from it.
      syncer_busy: for `during_merge`: True while a fragment has pending pushes.
    """

    def __init__(
        self,
        schedule: Schedule,
        target: Target,
        control_dir: str | pathlib.Path,
        log: Callable[[dict[str, Any]], None],
        t0: float,
        syncer_busy: Callable[[], bool] | None = None,
    ):
        super().__init__(name="chaos-injector", daemon=True)
        self.schedule, self.target, self.log, self.t0 = schedule, target, log, t0
        self.control_dir = pathlib.Path(control_dir)
        self.syncer_busy = syncer_busy
        self.halt = threading.Event()
        self.injected = 0
        # Per learner: active control faults (slow/link), merged into one control file.
        self._active: dict[int, dict[int, Fault]] = {}
        self._undo: list[tuple[float, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Stops injecting; faults still active stay as they are (the run is ending)."""
        self.halt.set()
        self.join(timeout=5)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _due(self, fault: Fault) -> bool:
        if fault.at_s is not None:
            return self._now() >= fault.at_s
        watched = 0 if fault.kind == "join" else fault.learner  # a joiner has no step yet
        return self.target.learner_step(watched) >= fault.at_step

    def run(self) -> None:  # noqa: D102 - threading.Thread.run
        pending = list(self.schedule.faults)
        while not self.halt.is_set() and (pending or self._undo):
            # A kill that waits for a merge goes last: its wait (up to 3 s) would otherwise hold
            # back the faults due with it (seen: a fast learner finished during the wait, so
            # its own kill, due at the same moment, found it gone).
            due = sorted((f for f in pending if self._due(f)), key=lambda f: f.during_merge)
            for fault in due:
                pending.remove(fault)
                try:
                    self._inject(fault)
                except Exception as error:  # noqa: BLE001 - a fault that fails is logged, not fatal.
                    self.log({"event": "fault_failed", **fault.describe(), "error": repr(error)})
            now = self._now()
            for entry in [u for u in self._undo if u[0] <= now]:
                self._undo.remove(entry)
                entry[1]()
            self.halt.wait(0.05)

    def _emit(self, event: str, fault: Fault, **extra: Any) -> None:
        self.log({"event": event, **fault.describe(), "at_wall_s": round(self._now(), 3), **extra})

    def _later(self, delay_s: float, fn: Callable[[], None]) -> None:
        if delay_s > 0:
            self._undo.append((self._now() + delay_s, fn))

    def _inject(self, fault: Fault) -> None:
        if fault.kind == "kill":
            if self.target.kill_learner(fault.learner, fault.repair_s):
                self.injected += 1
                self._emit("fault", fault)
            else:
                self._emit("fault_skipped", fault, reason="learner not running")
        elif fault.kind == "kill_syncer":
            busy = None  # whether a round had pending pushes at the kill (None: not asked)
            if fault.during_merge and self.syncer_busy is not None:
                # Pending pushes last milliseconds on a quiet machine: look for them a while,
                # then kill anyway and record that the kill missed a merge.
                deadline = time.monotonic() + 3
                busy = self.syncer_busy()
                while not busy and time.monotonic() < deadline:
                    if self.halt.is_set():  # the run ended first: say so, never kill late
                        self._emit("fault_skipped", fault, reason="run ended before a merge")
                        return
                    time.sleep(0.002)
                    busy = self.syncer_busy()
            if self.target.kill_syncer(fault.repair_s, fault.shard):
                self.injected += 1
                self._emit("fault", fault, **({} if busy is None else {"merge_pending": busy}))
            else:
                self._emit("fault_skipped", fault, reason="syncer not running")
        elif fault.kind in ("join", "leave"):
            act = self.target.join_learner if fault.kind == "join" else self.target.leave_learner
            if act(fault.learner):
                self._emit("membership", fault)
            else:
                why = "learner running already" if fault.kind == "join" else "learner not running"
                self._emit("fault_skipped", fault, reason=why)
        elif fault.kind == "pause":
            if not self.target.pause_learner(fault.learner):
                self._emit("fault_skipped", fault, reason="learner not running")
                return
            self.injected += 1
            self._emit("fault", fault)

            def resume(fault: Fault = fault) -> None:
                self.target.resume_learner(fault.learner)
                self._emit("recovery", fault)

            self._later(fault.duration_s or float("inf"), resume)
        else:  # slow, link: through the control file
            self.injected += 1
            self._set(fault, on=True)
            self._emit("fault", fault)

            def restore(fault: Fault = fault) -> None:
                self._set(fault, on=False)
                self._emit("recovery", fault)

            if fault.duration_s:
                self._later(fault.duration_s, restore)

    def _set(self, fault: Fault, on: bool) -> None:
        with self._lock:
            active = self._active.setdefault(fault.learner, {})
            if on:
                active[id(fault)] = fault
            else:
                active.pop(id(fault), None)
            values: dict[str, Any] = {"seed": self.schedule.seed, "slowdown": 1.0}
            for f in active.values():
                if f.kind == "slow":
                    values["slowdown"] = max(values["slowdown"], f.factor)
                else:
                    values["latency_s"] = max(values.get("latency_s", 0.0), f.latency_s)
                    values["drop"] = max(values.get("drop", 0.0), f.drop)
                    if f.bandwidth_mbps:
                        values["bandwidth_mbps"] = f.bandwidth_mbps
            write_controls(self.control_dir, fault.learner, values)
