"""A run's fault wiring: its folders, children's environments, injector, resilience summary.

`prepare_run` starts fresh timeline and chaos folders and loads the schedule; `learner_env`
says which fault controls a child owns; `start_injector` plays the schedule; `chaos_summary`
gives the summary's goodput, uptime, faults and recoveries.

Used by both local launchers (`local.launch` for `decoupled`, `local.synchronous` for `dp` and
`diloco`) around their `local.supervisor.Supervisor`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from decoupled_diloco import config as config_lib
from decoupled_diloco.chaos import faults as chaos
from decoupled_diloco.chaos.injector import Injector
from decoupled_diloco.local import scaling
from decoupled_diloco.local.supervisor import EventLog, Supervisor
from decoupled_diloco.obs import timeline as timeline_lib


def prepare_run(config: Any, workdir: pathlib.Path) -> tuple[Any, dict[str, str], Any]:
    """Readies `workdir` for a run: a fresh timeline, and under `config.chaos` the schedule.

    Returns:
      (config with an absolute `chaos` path, environment for every child, the schedule or None).

    Raises:
      chaos.ChaosError: the schedule cannot be read or names a learner that does not exist.
    """
    timeline_dir, control_dir = workdir / "timeline", workdir / "chaos"
    # A fresh run: nothing from an earlier one (no stale scale requests either).
    for folder in (timeline_dir, control_dir, workdir / scaling.FOLDER):
        for path in folder.glob("*") if folder.exists() else []:
            path.unlink()
    timeline_dir.mkdir(parents=True, exist_ok=True)
    env = {timeline_lib.DIR_ENV: str(timeline_dir)}
    if not config.chaos:
        return config, env, None
    path = str(pathlib.Path(config.chaos).absolute())
    config = dataclasses.replace(config, chaos=path)
    schedule = chaos.load(path, config.num_learners, config_lib.max_learners(config))
    changes = sorted({f.kind for f in schedule.faults if f.kind in chaos.MEMBERSHIP})
    if changes and not (config.mode == "decoupled" and config_lib.data_leases(config)):
        raise chaos.ChaosError(
            f"{path}: {' and '.join(changes)} events need a decoupled run with data leases "
            f"(decoupled.data_shards > 0 and one syncer shard); this run is {config.mode!r} "
            f"with data_shards={config.decoupled.data_shards}"
        )
    env[chaos.DIR_ENV] = str(control_dir)
    return config, env, schedule


def learner_env(learner: int, leader: bool = True) -> dict[str, str]:
    """The environment of a process of learner `learner`: which fault controls are its own.

    Only an island's leader process records the learner's timeline (`leader`); the other
    processes of a multi-process island step in lockstep with it.
    """
    env = {chaos.LEARNER_ENV: str(learner)}
    if not leader:
        env[timeline_lib.DIR_ENV] = ""
    return env


def start_injector(
    schedule: chaos.Schedule, supervisor: Supervisor, workdir: pathlib.Path, client: Any = None
) -> Injector:
    """Starts playing `schedule`; `at_s` counts from the event log's start."""

    def syncer_busy() -> bool:
        try:
            return any(f["pending"] for f in client.status()["fragments"])
        except Exception:  # noqa: BLE001 - a syncer that does not answer is not mid-merge.
            return False

    injector = Injector(
        schedule,
        supervisor,
        workdir / "chaos",
        supervisor.log,
        supervisor.log.t0,
        syncer_busy if client is not None else None,
    )
    injector.start()
    return injector


def chaos_summary(workdir: pathlib.Path, log: EventLog | None, t_end: float) -> dict[str, Any]:
    """The summary's resilience fields, from the run's timeline and event log."""
    result = timeline_lib.analyze(timeline_lib.load(workdir / "timeline"), t_end=t_end)
    return {
        "goodput": result.goodput,
        "uptime": result.uptime,
        "lost_steps": result.lost_steps,
        "failures_injected": log.faults if log else 0,
        "recoveries": log.recoveries if log else 0,
        "chaos_events": log.events if log else [],
        "timeline": result.as_dict(),
    }


def write_timeline_png(workdir: pathlib.Path) -> pathlib.Path | None:
    """Draws `workdir/timeline.png` (learner states and faults); None if it cannot be drawn."""
    from decoupled_diloco.obs import timeline_plot

    try:
        return timeline_plot.plot_timeline(workdir)
    except Exception as error:  # noqa: BLE001 - a picture never fails a finished run.
        print(f"[chaos] no timeline picture: {type(error).__name__}: {error}", flush=True)
        return None
