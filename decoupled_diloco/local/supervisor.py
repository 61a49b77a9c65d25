"""The local process manager: starts a run's processes, and restarts killed ones after repair.

`Supervisor` owns named children (a syncer, learners, or the one process of a synchronous run),
each carrying some learners. The chaos injector asks it to kill, pause or resume the process of
a learner; a killed process is down for its repair time, then started again with the same
command (a learner restores its checkpoint and rejoins; a syncer restores its state and listens
on the same port), or, with `config.supervisor.standby`, by activating a warm spare learner
process as it (`standby.Spares`). It records `down` (the failed learner's repair: not billed)
and `waiting` (healthy learners of the same process, idled by the failure) in the timeline,
and every fault and recovery in `metrics.jsonl`.

A child that dies on its own (killed from outside, out of memory, a crash) is restarted the same
way, after a backoff, as an orchestrator would (`config.supervisor`: restart budget, crash-loop
detection); the other processes of its island go down and come back with it. The run fails
only when a child exhausts its budget or crash-loops: the error names it and quotes its log.

`local.synchronous.run_synchronous` runs `dp` or `diloco` the same way, as one supervised child.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import config as config_lib
from decoupled_diloco.local import scaling
from decoupled_diloco.local.procs import Processes
from decoupled_diloco.obs import timeline as timeline_lib

CHILD_ENV = "DD_CHAOS_CHILD"  # set in the process a synchronous run supervises


class EventLog:
    """Appends fault and recovery events to `workdir/metrics.jsonl`, with wall time.

    Opened in append mode, like `MetricsWriter`, so the two share the file safely.
    """

    def __init__(self, workdir: pathlib.Path, t0: float):
        self.path = workdir / "metrics.jsonl"
        self.t0 = t0  # time.monotonic() at the start of the run
        self.faults = self.recoveries = 0
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        """Writes one event (`event`: "fault", "recovery", "fault_skipped", ...)."""
        record = {"time": time.time(), "wall_s": round(time.monotonic() - self.t0, 3), **event}
        with self._lock:
            self.faults += event.get("event") == "fault"
            self.recoveries += event.get("event") == "recovery"
            self.events.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        print(f"[chaos] {json.dumps(record)}", flush=True)


@dataclasses.dataclass
class Child:
    """A supervised process: its command, the learners it carries, and its lifecycle."""

    name: str
    command: list[str]
    learners: list[int]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restart_at: float | None = None  # monotonic; set while it is down
    killed: bool = False  # the last death was ours
    paused: bool = False
    restarts: int = 0
    warm: bool = False  # its process is an activated warm standby (`standby`)
    started_at: float = 0.0  # monotonic, of its current process
    deaths: int = 0  # unexpected deaths so far (not ours)
    quick_deaths: int = 0  # consecutive unexpected deaths within `min_uptime_s` of a start
    left: bool = False  # asked to leave for good (SIGTERM): never restarted


class Supervisor:
    """Starts, kills, pauses and restarts a run's children (see the module doc).

    Args:
      procs: where children are started (logs, environment, reaping).
      timeline_dir: the run's timeline folder (`down`/`waiting`/`starting` records).
      log: the event log.
      policy: how unexpected deaths are restarted (`config.supervisor`); None: the defaults.
    """

    def __init__(
        self,
        procs: Processes,
        timeline_dir: pathlib.Path,
        log: EventLog,
        policy: config_lib.SupervisorConfig | None = None,
    ):
        self.procs, self.log = procs, log
        self.policy = policy or config_lib.SupervisorConfig()
        self.timeline = timeline_lib.Timeline(timeline_dir, "supervisor", [])
        self.timeline_dir = timeline_dir
        self.children: dict[str, Child] = {}
        self.down_until: dict[int, float] = {}  # learner -> end of its repair (monotonic)
        self.error: str | None = None
        # `standby.Spares` (config.supervisor.standby): restarts activate warm spare learners.
        self.spares: Any = None
        # Elastic membership: `spawn(i)` starts learner i (set by the launcher); `scale_dir`
        # is the run folder whose scale requests (`local.scaling`) are taken on every poll.
        self.spawn: Callable[[int], None] | None = None
        self.scale_dir: pathlib.Path | None = None
        self._joins: list[int] = []  # joins asked from other threads, started by `poll`
        self._lock = threading.RLock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    # Children --------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        command: list[str],
        learners: Sequence[int] = (),
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Starts a child now and supervises it from then on."""
        with self._lock:
            child = Child(name, list(command), list(learners), dict(env or {}))
            self.children[name] = child
            self._start(child)
            return child.proc

    def _start(self, child: Child) -> None:
        if child.learners:
            self.timeline.enter("starting", learners=child.learners)
        spare = None
        if self.spares is not None and child.restarts:  # a warm spare becomes the learner
            spare = self.spares.activate(
                child.name, self._command(child), child.learners, child.env
            )
        child.proc, child.warm = spare, spare is not None
        if spare is None:
            with warnings.catch_warnings():
                # JAX warns on every fork of a process that imported it; the child execs at once.
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
                child.proc = self.procs.start(child.name, self._command(child), child.env)
        if self.spares is not None and child.learners:
            self.spares.note_start(child.name)
        child.restart_at, child.killed, child.paused = None, False, False
        child.started_at = time.monotonic()

    @staticmethod
    def _command(child: Child) -> list[str]:
        """The child's command; a server that picked a free port keeps that port on restarts."""
        command = list(child.command)
        files = [a.split("=", 1)[1] for a in command if a.startswith("--port_file=")]
        if files and "--port=0" in command and pathlib.Path(files[0]).exists():
            port = pathlib.Path(files[0]).read_text().strip()
            if re.fullmatch(r"\d+", port):
                command[command.index("--port=0")] = f"--port={port}"
        return command

    def start_thread(self) -> None:
        """Starts the background loop that restarts repaired children."""
        self._thread.start()

    def stop(self) -> None:
        """Stops the restart loop (children keep running; `procs.reap()` ends them)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._halt.wait(0.05):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 - surfaced by `check()`.
                self.error = f"supervisor: {type(error).__name__}: {error}"

    def poll(self) -> None:
        """Restarts children whose repair is over; notes children that died on their own."""
        now = time.monotonic()
        with self._lock:
            if self.spares is not None and self.error is None:
                self.error = self.spares.poll()  # (starts spares; a dead one is an error)
            if self.scale_dir is not None:
                for request in scaling.take(self.scale_dir):
                    scaling.apply(self, request)
            while self._joins:
                learner = self._joins.pop(0)
                try:
                    self.spawn(learner)
                except ValueError as error:
                    self.log({"event": "scale_refused", "kind": "join", "learner": learner,
                              "reason": str(error)})  # fmt: skip
            for child in self.children.values():
                code = child.proc.poll() if child.proc else None
                if child.restart_at is not None:
                    if now >= child.restart_at and (child.proc is None or code is not None):
                        child.restarts += 1
                        self._start(child)
                        self.log(
                            {
                                "event": "recovery",
                                "kind": "restart",
                                "process": child.name,
                                "learners": child.learners,
                                "restarts": child.restarts,
                                **({"warm_standby": child.warm} if self.spares else {}),
                            }
                        )
                elif code not in (None, 0) and self.error is None and not child.left:
                    self._died(child, code, now)

    def _died(self, child: Child, code: int, now: float) -> None:
        """A child died on its own: schedules its restart, or fails the run (module doc)."""
        policy = self.policy
        child.deaths += 1
        uptime = now - child.started_at
        child.quick_deaths = child.quick_deaths + 1 if uptime < policy.min_uptime_s else 0
        how = f"exit code {code}" + (f" (signal {-code})" if code < 0 else "")
        if child.deaths > policy.max_restarts:
            self.error = (
                f"{child.name} died {child.deaths} times ({how} the last time): its restart "
                f"budget (supervisor.max_restarts={policy.max_restarts}) is spent; its log "
                f"ends with:\n{self.procs.tail(child.name)}"
            )
            return
        if child.quick_deaths >= policy.crash_loop:
            self.error = (
                f"{child.name} is crash-looping: it died {child.quick_deaths} times in a row "
                f"within {policy.min_uptime_s:g} s of starting ({how} the last time; "
                f"supervisor.crash_loop={policy.crash_loop}); its log ends with:\n"
                f"{self.procs.tail(child.name)}"
            )
            return
        delay = min(policy.restart_backoff_s * 2 ** max(child.quick_deaths - 1, 0), 30.0)
        t = time.time()
        # The other processes of its island (multi-process learners) cannot go on without it.
        group = [
            c
            for c in self.children.values()
            if c is child
            or (
                c.learners
                and set(c.learners) & set(child.learners)
                and not (c.proc is not None and c.proc.poll() == 0)  # finished its share
            )
        ]
        for other in group:
            if other is not child and other.proc is not None and other.proc.poll() is None:
                other.proc.kill()
                other.proc.wait()
                other.killed = True
            other.restart_at = now + delay
        if child.learners:
            self.timeline.enter("down", t=t, learners=child.learners)
        self.log(
            {
                "event": "crash",
                "process": child.name,
                "learners": child.learners,
                "code": code,
                "uptime_s": round(uptime, 3),
                "deaths": child.deaths,
                "restart_in_s": delay,
            }
        )

    def check(self) -> None:
        """Raises the first unexpected failure, if any.

        Raises:
          RuntimeError: a child spent its restart budget or crash-loops (its log tail included).
        """
        if self.error:
            raise RuntimeError(self.error)

    def finished(self, names: Sequence[str]) -> bool:
        """Whether these children all exited cleanly and none is waiting for a restart."""
        with self._lock:
            children = [self.children[n] for n in names]
            return all(
                c.restart_at is None
                and c.proc is not None
                and (c.proc.poll() == 0 or (c.left and c.proc.poll() is not None))
                for c in children
            )

    def learner_names(self) -> list[str]:
        """The children that carry learners: the starting ones and every one that joined."""
        with self._lock:
            return [n for n, c in self.children.items() if c.learners]

    def learner_ids(self) -> list[int]:
        """Every learner id a child carries, sorted."""
        with self._lock:
            return sorted({i for c in self.children.values() for i in c.learners})

    def settle(self, timeout_s: float) -> None:
        """Waits until no child is down waiting for its restart (e.g. a syncer killed late)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(c.restart_at is None for c in self.children.values()):
                    return
            self.check()
            time.sleep(0.05)

    def carrier(self, learner: int) -> Child | None:
        """The child that carries `learner`."""
        return next((c for c in self.children.values() if learner in c.learners), None)

    # injector.Target ----------------------------------------------------------------------------

    def kill_learner(self, learner: int, repair_s: float) -> bool:
        """Kills (SIGKILL) the process(es) carrying `learner`.

        They restart once every learner they carry is repaired. Returns False if `learner` is
        already down or has finished.
        """
        with self._lock:
            now, t = time.monotonic(), time.time()
            if self.down_until.get(learner, 0.0) > now:
                return False
            carriers = [c for c in self.children.values() if learner in c.learners and not c.left]
            alive = [c for c in carriers if c.proc is not None and c.proc.poll() is None]
            down = [c for c in carriers if c.restart_at is not None]
            # Died on its own a moment ago, not yet noticed by `poll`: down already, so the
            # fault takes it as its kill (the repair time, not the crash backoff).
            dead = [
                c
                for c in carriers
                if c.restart_at is None and c.proc is not None and c.proc.poll() not in (None, 0)
            ]
            if not alive and not down and not dead:
                return False  # finished its share
            for child in alive:
                child.proc.kill()
                child.proc.wait()
            for child in alive + dead:
                child.killed, child.paused = True, False
            self.down_until[learner] = now + repair_s
            self.timeline.enter("down", t=t, learners=[learner])
            for child in alive + dead + down:
                healthy = [
                    x for x in child.learners if x != learner and self.down_until.get(x, 0) <= now
                ]
                if healthy and child not in down:  # a synchronous group idles during the repair
                    self.timeline.enter("waiting", t=t, learners=healthy)
                ends = [self.down_until.get(x, 0.0) for x in child.learners]
                child.restart_at = max([now + repair_s, *ends])
            return True

    def pause_learner(self, learner: int) -> bool:
        """Stops (SIGSTOP) the process of `learner`; False if it is not running."""
        with self._lock:
            child = self.carrier(learner)
            if child is None or child.proc is None or child.proc.poll() is not None:
                return False
            child.proc.send_signal(signal.SIGSTOP)
            child.paused = True
            self.timeline.enter("paused", learners=child.learners)
            return True

    def resume_learner(self, learner: int) -> None:
        """Continues (SIGCONT) a paused process; nothing if it was killed meanwhile."""
        with self._lock:
            child = self.carrier(learner)
            if child is None or not child.paused or child.proc is None:
                return
            child.proc.send_signal(signal.SIGCONT)
            child.paused = False
            if child.proc.poll() is None:
                # Until the process's own next record: it resumes mid-step, not a new step.
                self.timeline.enter("blocked", learners=child.learners)

    def kill_syncer(self, repair_s: float, shard: int = -1) -> bool:
        """Kills every syncer process, or shard `shard`'s; each restarts after `repair_s`."""
        names = {f"syncer_{shard}"} | ({"syncer"} if shard == 0 else set())
        with self._lock:
            syncers = [
                c
                for n, c in self.children.items()
                if (n in names if shard >= 0 else n.startswith("syncer"))
                and c.proc is not None
                and c.proc.poll() is None
            ]
            for child in syncers:
                child.proc.kill()
                child.proc.wait()
                child.killed = True
                child.restart_at = time.monotonic() + repair_s
            return bool(syncers)

    def learner_step(self, learner: int) -> int:
        """The last step `learner` recorded in its timeline (-1 before its first).

        A child writes its timeline as `CHILD_NAME.jsonl` (a learner, or a synchronous trainer).
        """
        child = self.carrier(learner)
        if child is None:
            return -1
        return timeline_lib.current_step(self.timeline_dir / f"{child.name}.jsonl")

    # Membership (chaos `join`/`leave`, `status --add_learner/--remove_learner`) ---------------

    def join_learner(self, learner: int) -> bool:
        """Starts learner `learner` through `spawn` (a join); False if it has a process already.

        Raises:
          ValueError: this run cannot add learners, or not this one (`spawn` says why).
        """
        with self._lock:
            if self.spawn is None:
                raise ValueError("this run cannot add learners (only a decoupled run can)")
            if self.carrier(learner) is not None or learner in self._joins:
                return False
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                # Started by the supervisor's own thread, which lives to the end of the run:
                # Linux sends a child its parent-death signal when the *thread* that started
                # it exits (`runtime.die_with_parent`), and the injector's thread ends early.
                self._joins.append(learner)
            else:
                self.spawn(learner)
            return True

    def leave_learner(self, learner: int) -> bool:
        """Ends `learner` for good; False if it is not running.

        SIGTERM: it flushes, releases its lease and exits. It is never restarted, and counts
        as finished once it exits.
        """
        with self._lock:
            carriers = [
                c
                for c in self.children.values()
                if learner in c.learners and c.proc is not None and c.proc.poll() is None
            ]
            for child in carriers:
                child.left = True
                child.proc.send_signal(signal.SIGTERM)
            return bool(carriers)
