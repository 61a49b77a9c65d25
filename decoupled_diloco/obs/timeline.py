"""Learner state timelines, and goodput and uptime computed from them the same way in every mode.

Every process that trains appends one JSON line per state change to `workdir/timeline/NAME.jsonl`:
`{"t": unix time, "state": S, "learners": [ids], "step": n}`. A decoupled learner writes its own
file; a synchronous trainer (`dp`, `diloco`) writes one file for all its learners, since they
change state together; the supervisor writes `down` (a failed machine waiting for repair) and
`waiting` (a healthy learner idled by someone else's failure) into `supervisor.jsonl`.
A record opens a state that lasts until the learner's next record; `stepping`/`compiling`
records name the step they start, so each step's wall time is known.

Definitions (docs/DESIGN.md, "Goodput and uptime"):
  * A learner's **allocated** time runs from its first record to its last `done` (or the end of
    the run), minus the time it spends `down` for repair: a failed machine is not billed while it
    is replaced, and a learner that has finished its share is released.
  * **Productive** time is the time of steps whose work survives to the final model. A step whose
    index is executed again later (the learner rolled back to a checkpoint after a failure) is
    lost: its time counts as allocated but not productive, and it is one of `lost_steps`. So do
    starting, compiling, restoring, blocked, waiting, checkpointing, evaluating and paused
    time.
  * **goodput** = productive time / allocated time, both summed over learners.
  * **uptime** = share of the training window (from the first step after compilation to the end
    of the last step) in which at least one learner is `stepping`. In a synchronous mode every
    learner steps together, so this is the share in which the group steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

STATES = (
    "starting",  # process spawned: interpreter, imports, model set-up
    "restoring",  # reading a checkpoint / catching up with the syncer
    "waiting",  # idle, waiting for others (peers to start, a failed peer's repair)
    "compiling",  # the first step after a (re)start, which compiles
    "stepping",  # an inner step
    "blocked",  # waiting on a sync or a final flush
    "checkpointing",  # writing a checkpoint inside the step loop
    "evaluating",  # a synchronous trainer evaluating (decoupled: the launcher evaluates)
    "paused",  # stopped by a fault (SIGSTOP)
    "down",  # dead, waiting for repair (not allocated)
    "done",  # finished its share; released
)
STEP_STATES = ("stepping", "compiling")
DIR_ENV = "DD_TIMELINE_DIR"


@dataclasses.dataclass(frozen=True)
class Record:
    """One state change of one learner."""

    t: float
    state: str
    step: int = -1


class Timeline:
    """Appends state changes for `learners` to `directory/NAME.jsonl` (one write per line).

    Opened with O_APPEND, so several writers (a restarted process, the supervisor) can share a
    file, and a line is on disk as soon as `enter` returns: a `kill -9` loses nothing written.

    Args:
      directory: the run's timeline folder (created if missing).
      name: file stem, e.g. "learner_0".
      learners: the learner ids these records are about.
    """

    def __init__(self, directory: str | pathlib.Path, name: str, learners: Sequence[int]):
        self.path = pathlib.Path(directory) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.learners = [int(x) for x in learners]
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.state = ""

    def enter(
        self,
        state: str,
        step: int = -1,
        t: float | None = None,
        learners: Sequence[int] | None = None,
        **extra: Any,
    ) -> None:
        """Records that the learners (default: this timeline's) enter `state` now (or at `t`).

        Args:
          state: one of `STATES`.
          step: the step a `stepping`/`compiling` record starts.
          t: unix time of the change (default: now).
          learners: the learners concerned, overriding this timeline's.
          **extra: more JSON fields for the record.
        """
        if state not in STATES:
            raise ValueError(f"unknown timeline state {state!r}; expected one of {STATES}")
        who = self.learners if learners is None else [int(x) for x in learners]
        record = {"t": time.time() if t is None else t, "state": state, "learners": who}
        if step >= 0:
            record["step"] = int(step)
        record.update(extra)
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        self.state = state

    def close(self) -> None:
        """Closes the file."""
        os.close(self._fd)

    @classmethod
    def from_env(cls, name: str, learners: Sequence[int]) -> Timeline | None:
        """The timeline under `$DD_TIMELINE_DIR` (set by the launcher), or None when unset."""
        directory = os.environ.get(DIR_ENV, "")
        return cls(directory, name, learners) if directory else None


def load(directory: str | pathlib.Path) -> dict[int, list[Record]]:
    """Every learner's records from all files in `directory`, in time order.

    Lines cut short by a crash are skipped.
    """
    out: dict[int, list[Record]] = {}
    for path in sorted(pathlib.Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                raw = json.loads(line)
                record = Record(float(raw["t"]), str(raw["state"]), int(raw.get("step", -1)))
                learners = raw["learners"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            for learner in learners:
                out.setdefault(int(learner), []).append(record)
    for records in out.values():
        records.sort(key=lambda r: r.t)  # stable: same-time records keep file order
    return out


@dataclasses.dataclass(frozen=True)
class LearnerStats:
    """One learner's accounting (seconds)."""

    allocated_s: float
    productive_s: float
    down_s: float
    lost_steps: int
    by_state: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Goodput:
    """A run's goodput, uptime and the per-learner accounting behind them."""

    goodput: float
    uptime: float
    lost_steps: int
    window_s: float
    learners: dict[int, LearnerStats]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (for summary.json)."""
        return {
            "goodput": self.goodput,
            "uptime": self.uptime,
            "lost_steps": self.lost_steps,
            "window_s": self.window_s,
            "learners": {str(k): dataclasses.asdict(v) for k, v in self.learners.items()},
        }


def intervals(records: Sequence[Record], t_end: float) -> list[tuple[float, float, Record]]:
    """(start, end, record) for each record: until the next record, the last one until `t_end`.

    `done` is terminal: nothing after a learner's last `done` is counted.
    """
    out = []
    for i, record in enumerate(records):
        end = records[i + 1].t if i + 1 < len(records) else t_end
        if record.state == "done" and i + 1 == len(records):
            end = record.t
        out.append((record.t, max(end, record.t), record))
    return out


def learner_stats(records: Sequence[Record], t_end: float) -> LearnerStats:
    """One learner's allocated and productive time (module doc), from its records."""
    spans = intervals(records, t_end)
    last_execution: dict[int, int] = {}
    for i, (_, _, record) in enumerate(spans):
        if record.state in STEP_STATES:
            last_execution[record.step] = i
    by_state: dict[str, float] = {}
    productive = 0.0
    lost = 0
    for i, (start, end, record) in enumerate(spans):
        by_state[record.state] = by_state.get(record.state, 0.0) + (end - start)
        if record.state in STEP_STATES and last_execution[record.step] != i:
            lost += 1
        elif record.state == "stepping":
            productive += end - start
    total = (spans[-1][1] - spans[0][0]) if spans else 0.0
    down = by_state.get("down", 0.0)
    return LearnerStats(total - down, productive, down, lost, by_state)


def _union_length(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    total, cursor = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, cursor), min(end, hi)
        if end > start:
            total += end - start
            cursor = end
    return total


def analyze(timelines: Mapping[int, Sequence[Record]], t_end: float | None = None) -> Goodput:
    """Goodput, uptime and lost steps of a run (module doc for the definitions).

    Args:
      timelines: each learner's records in time order (see `load`).
      t_end: end of the run, for learners without a final `done` (default: the last record).
    """
    if not timelines:
        return Goodput(0.0, 0.0, 0, 0.0, {})
    t_end = t_end if t_end is not None else max(r[-1].t for r in timelines.values() if r)
    stats = {k: learner_stats(v, t_end) for k, v in sorted(timelines.items()) if v}
    allocated = sum(s.allocated_s for s in stats.values())
    productive = sum(s.productive_s for s in stats.values())
    advancing = [
        (start, end)
        for records in timelines.values()
        for start, end, record in intervals(records, t_end)
        if record.state == "stepping"
    ]
    if not advancing:
        return Goodput(0.0, 0.0, sum(s.lost_steps for s in stats.values()), 0.0, stats)
    lo, hi = min(s for s, _ in advancing), max(e for _, e in advancing)
    window = hi - lo
    uptime = _union_length(advancing, lo, hi) / window if window > 0 else 0.0
    return Goodput(
        goodput=productive / allocated if allocated > 0 else 0.0,
        uptime=uptime,
        lost_steps=sum(s.lost_steps for s in stats.values()),
        window_s=window,
        learners=stats,
    )


def current_step(path: str | pathlib.Path) -> int:
    """The last step recorded in a timeline file (-1 if none), reading only its tail."""
    path = pathlib.Path(path)
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except json.JSONDecodeError:
            continue
        if step is not None:
            return int(step)
    return -1
