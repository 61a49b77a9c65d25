r"""`python -m decoupled_diloco.learner`: flags, the mesh, and one learner run to its summary.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=127.0.0.1:50051 \
      --learner_id=0 --config=experiments/configs/tiny_lm.py --config.mode=decoupled

`learner/__main__.py` defines the flags and calls `start`, which runs `main` (or waits as a
warm standby, see `standby`).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time
from typing import Any

from absl import app, flags

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime
from decoupled_diloco.chaos import faults as chaos
from decoupled_diloco.learner.learner import Learner
from decoupled_diloco.obs.timeline import Timeline
from decoupled_diloco.runtime import die_with_parent


def main(argv: list[str], warm: Any = None) -> None:
    """Parses flags, runs the learner, writes its summary (`warm`: a `standby.Warm`)."""
    values = flags.FLAGS
    config = config_lib.from_config_dict(values.config)
    shape = config_lib.mesh_shape_for(config, values.learner_id, values.mesh_shape)
    slowdown = values.slowdown or (
        config.slowdown if config.slow_learner == values.learner_id else 1.0
    )
    # Set by the local launcher (or a chaos supervisor): where states are recorded, and the
    # live fault controls. A multi-process island's leader records for the island.
    leader = values.num_processes == 1 or values.process_id == 0
    name = f"learner_{values.learner_id}"
    timeline = Timeline.from_env(name, [values.learner_id]) if leader else None
    controls = chaos.Controls.from_env(values.learner_id)
    if values.num_processes > 1:  # One island over several processes (hosts): see multihost.
        from decoupled_diloco.learner import multihost

        group = multihost.ProcessGroup(values.coordinator, values.num_processes, values.process_id)
        multihost.initialize(group, config.decoupled.island_heartbeat_s)
        learner = multihost.MultihostLearner(
            config,
            values.learner_id,
            values.syncer,
            group,
            mesh_shape=shape,
            slowdown=slowdown,
            workdir=values.workdir or None,
            timeline=timeline,
            controls=controls,
        )
    else:
        learner = Learner(
            config,
            values.learner_id,
            values.syncer,
            mesh_shape=shape,
            slowdown=slowdown,
            workdir=values.workdir or None,
            island=warm.island if warm else None,
            timeline=timeline,
            controls=controls,
        )
        learner.startup.update(warm.startup if warm else {})
        _leave_on_sigterm(learner)
    metrics = None
    if leader and values.metrics_port >= 0:  # docs/operations.md; served from now to the end
        from decoupled_diloco.comm import wire
        from decoupled_diloco.learner.metrics import serve_metrics
        from decoupled_diloco.obs.http import write_port

        secret = wire.run_token(config.decoupled.syncer)  # its credential, or the run token
        metrics = serve_metrics(learner, secret, values.metrics_host, values.metrics_port)
        if values.metrics_port_file:
            write_port(values.metrics_port_file, metrics.port)
        print(f"[learner {learner.id}] metrics at {metrics.url('/metrics')}", flush=True)
    learner.connect()
    learner.startup["connected"] = time.time()
    print(f"[learner {learner.id}] joined at versions {learner.sync.versions}", flush=True)
    summary = learner.run()
    if values.summary:  # whole or not at all: a restart may be killed mid-write
        path = pathlib.Path(values.summary)
        path.with_suffix(".tmp").write_text(json.dumps(summary, indent=2) + "\n")
        path.with_suffix(".tmp").replace(path)
    stall = 100 * summary["stall_fraction"]
    print(f"[learner {learner.id}] done: {summary['steps']} steps, stall {stall:.2f}%", flush=True)
    if metrics is not None:
        metrics.stop()


def _leave_on_sigterm(learner: Learner) -> None:
    """SIGTERM: leave gracefully (finish the step, push, say done); a second one ends it now.

    (A multi-process island keeps the default: its processes would not stop at the same step.)
    """

    def leave(*_: Any) -> None:
        print(f"[learner {learner.id}] SIGTERM: leaving after this step", flush=True)
        learner.leave()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, leave)


def start() -> None:
    """Runs the learner of the flags that `learner/__main__.py` defined.

    The flags are defined there, in the module that `python -m` runs, so that `--help` lists
    them (absl shows the main module's flags).
    """
    die_with_parent()

    def _start(argv: list[str]) -> None:
        # On CPU, fake as many devices as the mesh needs (and raise XLA:CPU's collective
        # timeouts), before JAX picks a backend.
        from absl import logging

        from decoupled_diloco.runtime import configure_cpu_devices

        if not flags.FLAGS["verbosity"].present:  # Orbax logs every checkpoint at INFO
            logging.set_verbosity(logging.WARNING)
        config = config_lib.from_config_dict(flags.FLAGS.config)
        shape = config_lib.mesh_shape_for(config, flags.FLAGS.learner_id, flags.FLAGS.mesh_shape)
        from decoupled_diloco.learner.multihost import local_device_count

        configure_cpu_devices(local_device_count(shape[0] * shape[1], flags.FLAGS.num_processes))
        # A restarted learner loads its compiled step from the persistent cache.
        runtime.use_compile_cache()
        runtime.tune_malloc()  # before any thread: see its doc
        try:
            if flags.FLAGS.standby:  # a warm spare: set up now, told which learner later
                from decoupled_diloco.learner import standby

                standby.serve(flags.FLAGS.standby, config, shape, main)
            else:
                main(argv)
        except KeyboardInterrupt:
            # Ctrl+C: leave now; background syncs hold no state worth waiting for.
            os._exit(130)

    sys.exit(app.run(_start))
