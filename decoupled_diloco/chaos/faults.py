"""Seeded fault schedules, the per-learner fault controls, and the injector that plays a schedule.

A schedule is a YAML file (`--config.chaos=experiments/chaos/NAME.yaml`):

  seed: 0                        # seeds generated faults and the link's random drops
  faults:                        # explicit faults, each at `at_s` seconds after the run starts,
                                 # or when `learner` reaches `at_step`
    - {at_s: 20, kind: kill, learner: 1, repair_s: 10}       # kill -9, restart after repair_s
    - {at_step: 120, kind: kill, learner: 0, repair_s: 10}
    - {at_s: 30, kind: pause, learner: 0, duration_s: 5}     # SIGSTOP, SIGCONT after duration_s
    - {at_s: 40, kind: slow, learner: 1, factor: 3, duration_s: 10}   # steps 3x longer
    - {at_s: 0, kind: link, learner: 1, latency_s: 0.05, bandwidth_mbps: 10, drop: 0.3}
    - {at_s: 60, kind: kill_syncer, repair_s: 5, during_merge: true}   # shard: S for one shard
    - {at_step: 40, kind: join, learner: 2}    # a new learner joins (at_step: learner 0's)
    - {at_s: 90, kind: leave, learner: 0}      # SIGTERM: it flushes, releases its lease, exits
  failure_model:                 # optional: generated kills, added to `faults`
    mtbf_s: 120                  # mean time between failures, per learner (exponential)
    repair_s: 20                 # down time before the restart
    duration_s: 600              # generate failures up to this time
    seed: 0                      # default: the top-level seed

`duration_s: 0` (the default) makes a pause, slow or link fault last to the end of the run.
Faults that come due after the run has ended are never injected. The same schedule drives every
mode: in `decoupled` a learner fault hits that learner's process; in `dp` and `diloco`, which run
every learner in one process, a kill ends the whole process (as one dead chip stops a
synchronous job), and a pause stops it. `join` and `leave` change a decoupled run's membership
(they need data leases, `decoupled.data_shards` > 0): a join starts learner `learner` (an id
from `num_learners` up to `decoupled.max_learners`), a leave ends one gracefully for good.

Slow-downs and link faults reach a learner through a small JSON control file
(`$DD_CHAOS_DIR/learner_I.json`) that the learner (step loop) and its gRPC channel
(`comm.faulty_link`) re-read when it changes; the injector (`chaos/injector.py`) rewrites it
atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
from collections.abc import Mapping
from typing import Any

KINDS = ("kill", "pause", "slow", "link", "kill_syncer", "join", "leave")
MEMBERSHIP = ("join", "leave")  # the kinds that change who trains
DIR_ENV = "DD_CHAOS_DIR"
LEARNER_ENV = "DD_CHAOS_LEARNER"


class ChaosError(ValueError):
    """A fault schedule that cannot work; the message names the fault and field."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault (see the module doc for the YAML form).

    Attributes:
      kind: one of `KINDS`.
      at_s: seconds after the run starts; None when triggered by `at_step`.
      at_step: inject when `learner` has reached this step (instead of `at_s`).
      learner: the target learner (-1 for `kill_syncer`); join: the id that joins.
      repair_s: kill, kill_syncer: seconds down before the restart.
      duration_s: pause, slow, link: seconds the fault lasts (0: to the end of the run).
      factor: slow: steps take this many times longer.
      latency_s: link: added to every call.
      bandwidth_mbps: link: cap on the bytes streamed each way (0: no cap).
      drop: link: share of calls dropped (half lose the request, half the reply).
      during_merge: kill_syncer: wait (up to 30 s) until a fragment has pending pushes.
      shard: kill_syncer: only this syncer shard (-1: every shard).
    """

    kind: str
    at_s: float | None = None
    at_step: int | None = None
    learner: int = -1
    repair_s: float = 0.0
    duration_s: float = 0.0
    factor: float = 1.0
    latency_s: float = 0.0
    bandwidth_mbps: float = 0.0
    drop: float = 0.0
    during_merge: bool = False
    shard: int = -1

    def describe(self) -> dict[str, Any]:
        """The fields that differ from the defaults (for metrics.jsonl)."""
        default = Fault(self.kind)
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name) or f.name == "kind"
        }


@dataclasses.dataclass(frozen=True)
class FailureModel:
    """Kills drawn per learner: exponential gaps of mean `mtbf_s` between a repair and the next."""

    mtbf_s: float
    repair_s: float
    duration_s: float
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A validated, time-ordered list of faults."""

    faults: tuple[Fault, ...]
    seed: int = 0

    def validate(self, num_learners: int, max_learners: int = 0) -> None:
        """Checks every target against `num_learners` starting and `max_learners` at most.

        Raises:
          ChaosError: a fault names a learner that does not exist (or never joins), or a
            join names one that already trains.
        """
        joins = {f.learner for f in self.faults if f.kind == "join"}
        limit = max(max_learners, num_learners)
        for i, fault in enumerate(self.faults):
            if fault.kind == "join" and not num_learners <= fault.learner < limit:
                raise ChaosError(
                    f"faults[{i}].learner: a join needs an id in [{num_learners}, {limit}) "
                    f"(num_learners={num_learners}, decoupled.max_learners={limit}), got "
                    f"{fault.learner}"
                )
            known = fault.learner < num_learners or fault.learner in joins
            if fault.kind != "kill_syncer" and not (0 <= fault.learner < limit and known):
                raise ChaosError(
                    f"faults[{i}].learner: no learner {fault.learner} among {num_learners} "
                    f"(and the joins {sorted(joins)})"
                )
            if fault.at_step is not None and fault.kind == "kill_syncer" and fault.learner < 0:
                raise ChaosError(f"faults[{i}].at_step: needs `learner` (whose step to watch)")


def generate(model: FailureModel, num_learners: int) -> list[Fault]:
    """Kills for every learner from `model`; the same model and seed give the same faults."""
    faults = []
    for learner in range(num_learners):
        # One generator per learner: adding a learner does not move the others' failures.
        rng = random.Random(f"{model.seed}:{learner}")
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / model.mtbf_s)
            if t >= model.duration_s:
                break
            faults.append(Fault("kill", at_s=round(t, 3), learner=learner, repair_s=model.repair_s))
            t += model.repair_s
    return faults


_FIELDS = {f.name for f in dataclasses.fields(Fault)}
_NUMBERS = ("at_s", "repair_s", "duration_s", "factor", "latency_s", "bandwidth_mbps", "drop")


def _fault(raw: Any, i: int) -> Fault:
    where = f"faults[{i}]"
    if not isinstance(raw, Mapping):
        raise ChaosError(f"{where}: expected a mapping of fields, got {raw!r}")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ChaosError(f"{where}.{unknown[0]}: no such field (known: {sorted(_FIELDS)})")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ChaosError(f"{where}.kind: {kind!r} is not one of {KINDS}")
    for name in _NUMBERS:
        value = raw.get(name, 0)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ChaosError(f"{where}.{name}: expected a number, got {value!r}")
        if value is not None and value < 0:
            raise ChaosError(f"{where}.{name}: must be >= 0, got {value}")
    for name in ("learner", "shard"):
        value = raw.get(name, -1)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ChaosError(f"{where}.{name}: expected an integer, got {value!r}")
    if not isinstance(raw.get("during_merge", False), bool):
        raise ChaosError(f"{where}.during_merge: expected true/false, got {raw['during_merge']!r}")
    if ("at_s" in raw) == ("at_step" in raw):
        raise ChaosError(f"{where}: give exactly one of at_s and at_step")
    fault = Fault(**{k: (float(v) if k in _NUMBERS else v) for k, v in raw.items()})
    if fault.at_step is not None and (not isinstance(fault.at_step, int) or fault.at_step < 0):
        raise ChaosError(f"{where}.at_step: expected a step >= 0, got {fault.at_step!r}")
    if fault.kind == "slow" and fault.factor < 1:
        raise ChaosError(f"{where}.factor: a slow-down factor must be >= 1, got {fault.factor}")
    if fault.drop >= 1:
        raise ChaosError(f"{where}.drop: must be < 1 (a share of calls), got {fault.drop}")
    if fault.kind in ("kill", "pause", "slow", "link", *MEMBERSHIP) and fault.learner < 0:
        raise ChaosError(f"{where}.learner: a {fault.kind} fault needs a learner >= 0")
    return fault


def parse(data: Any) -> tuple[Schedule, FailureModel | None]:
    """Reads parsed YAML/JSON (see the module doc): the explicit faults and the failure model.

    Raises:
      ChaosError: an unknown field or a bad value, named in the message.
    """
    if not isinstance(data, Mapping):
        raise ChaosError(f"a fault schedule is a mapping with `faults`/`failure_model`: {data!r}")
    unknown = sorted(set(data) - {"seed", "faults", "failure_model"})
    if unknown:
        raise ChaosError(f"{unknown[0]}: no such field (known: seed, faults, failure_model)")
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ChaosError(f"seed: expected an integer, got {seed!r}")
    raw_faults = data.get("faults") or []
    if not isinstance(raw_faults, list):
        raise ChaosError(f"faults: expected a list, got {raw_faults!r}")
    faults = [_fault(raw, i) for i, raw in enumerate(raw_faults)]
    model = data.get("failure_model")
    if model is not None:
        names = {f.name for f in dataclasses.fields(FailureModel)}
        if not isinstance(model, Mapping) or set(model) - names:
            raise ChaosError(f"failure_model: expected fields {sorted(names)}, got {model!r}")
        for name in ("mtbf_s", "repair_s", "duration_s"):
            value = model.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ChaosError(f"failure_model.{name}: expected a number >= 0, got {value!r}")
        if model["mtbf_s"] <= 0:
            raise ChaosError("failure_model.mtbf_s: must be > 0")
        return Schedule(tuple(faults), seed), FailureModel(
            float(model["mtbf_s"]),
            float(model["repair_s"]),
            float(model["duration_s"]),
            int(model.get("seed", seed)),
        )
    return Schedule(tuple(faults), seed), None


def load(path: str | pathlib.Path, num_learners: int, max_learners: int = 0) -> Schedule:
    """Reads a schedule file and expands its failure model for `num_learners` learners.

    `max_learners`: the most learners the run may have (joins name ids below it).

    Raises:
      ChaosError: the file is missing, not YAML, or holds a bad schedule (named in the message).
    """
    import yaml

    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ChaosError(f"cannot read fault schedule {path}: {error}") from None
    except yaml.YAMLError as error:
        raise ChaosError(f"{path} is not valid YAML: {error}") from None
    try:
        schedule, model = parse(data)
    except ChaosError as error:
        raise ChaosError(f"{path}: {error}") from None
    faults = list(schedule.faults) + (generate(model, num_learners) if model else [])
    faults.sort(key=lambda f: (f.at_s is None, f.at_s or 0.0, f.learner))
    schedule = Schedule(tuple(faults), schedule.seed)
    try:
        schedule.validate(num_learners, max_learners)
    except ChaosError as error:
        raise ChaosError(f"{path}: {error}") from None
    return schedule


# Controls: what a live learner reads ---------------------------------------------------------


def control_path(directory: str | pathlib.Path, learner: int) -> pathlib.Path:
    """Learner `learner`'s control file."""
    return pathlib.Path(directory) / f"learner_{learner}.json"


def write_controls(directory: str | pathlib.Path, learner: int, values: Mapping[str, Any]) -> None:
    """Atomically replaces a learner's controls (slowdown, latency_s, bandwidth_mbps, drop)."""
    path = control_path(directory, learner)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(values)))
    tmp.replace(path)


class Controls:
    """A learner's live fault controls, re-read only when the file changes (one stat per call).

    Args:
      path: the control file; missing means no fault.
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._stamp: tuple[int, int] | None = None
        self._values: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
        """The current values ({} without a fault)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._values = None, {}
            return self._values
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            try:
                self._values = json.loads(self.path.read_text())
                self._stamp = stamp
            except (OSError, json.JSONDecodeError):
                pass  # Mid-replace: keep the previous values, re-read next time.
        return self._values

    def slowdown(self) -> float:
        """The step slow-down factor (1: none)."""
        return float(self.get().get("slowdown", 1.0))

    @classmethod
    def from_env(cls, learner: int | None = None) -> Controls | None:
        """This process's controls for `learner` (default `$DD_CHAOS_LEARNER`); None if unset."""
        directory = os.environ.get(DIR_ENV, "")
        if learner is None:
            learner = int(os.environ.get(LEARNER_ENV, "-1"))
        if not directory or learner < 0:
            return None
        return cls(control_path(directory, learner))
