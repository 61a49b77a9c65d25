"""`dp` or `diloco` under a fault schedule, the way a real synchronous job lives.

The whole job is one process, killed when any learner fails, restarted from its last checkpoint
once every failed learner is repaired (or, after a death nobody asked for, by the supervisor's
restart policy).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime
from decoupled_diloco.local.chaos_run import (
    chaos_summary,
    prepare_run,
    start_injector,
    write_timeline_png,
)
from decoupled_diloco.local.procs import Processes
from decoupled_diloco.local.supervisor import CHILD_ENV, EventLog, Supervisor
from decoupled_diloco.tasks import python_path


def run_synchronous(config: Any, workdir: pathlib.Path) -> dict[str, Any]:
    """Runs `dp`/`diloco` under `config.chaos` in a supervised child process; returns the summary.

    The child is `python -m experiments.train` on the same config (with `DD_CHAOS_CHILD` set, so
    it trains instead of supervising). A learner fault kills the child; once every failed
    learner's repair is over it restarts and resumes from its newest checkpoint (every
    `checkpoint.every` steps; without checkpoints it starts over).

    Raises:
      RuntimeError: the child failed on its own (its log tail is in the message).
    """
    t0 = time.monotonic()
    workdir = pathlib.Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    config, chaos_env, schedule = prepare_run(config, workdir)
    config_file = config_lib.write_config_file(config, workdir / "config.py")
    (workdir / "summary.json").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({CHILD_ENV: "1", **chaos_env})
    env["PYTHONPATH"] = python_path(config)  # the child imports `config.task` too
    procs = Processes(workdir / "logs", env)
    log = EventLog(workdir, t0)
    supervisor = Supervisor(procs, workdir / "timeline", log, config.supervisor)
    command = [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config={config_file}",
        f"--workdir={workdir}",
    ]
    injector = None
    # Ctrl+C and SIGTERM run the `finally` below (the child is reaped), within a bound.
    restore_signals = runtime.exit_on_signals()
    try:
        supervisor.add("trainer", command, learners=range(config.num_learners))
        supervisor.start_thread()
        injector = start_injector(schedule, supervisor, workdir)
        while not supervisor.finished(["trainer"]):
            supervisor.check()
            time.sleep(0.1)
    finally:
        if injector is not None:
            injector.halt.set()
        supervisor.stop()
        procs.reap()
        restore_signals()
    summary = json.loads((workdir / "summary.json").read_text())
    summary.update(chaos_summary(workdir, log, t_end=time.time()))
    summary["wall_s"] = time.monotonic() - t0
    from decoupled_diloco.obs.metrics import write_summary

    write_summary(workdir, summary)
    write_timeline_png(workdir)
    return summary
