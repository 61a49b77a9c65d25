r"""`python -m decoupled_diloco.syncer`: one syncer process (or one shard of it).

  DD_RUN_TOKEN=secret python -m decoupled_diloco.syncer --port=50051 \
      --config=experiments/configs/tiny_lm.py --config.mode=decoupled

Reads the flags and the environment (the run token, `DD_RUN_TOKEN`), builds a `SyncerServer`
and serves until SIGTERM or SIGINT.
"""

import os
import signal
import sys
import threading

from absl import app, flags, logging
from ml_collections import config_flags

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime
from decoupled_diloco.obs.http import write_port
from decoupled_diloco.syncer.metrics import serve_metrics
from decoupled_diloco.syncer.server import SyncerServer, pause_in_merge

STOP_DEADLINE_S = 4.5  # after SIGTERM: the syncer is gone within 5 s

config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
flags.DEFINE_string("host", "", "Interface to bind (default: config.decoupled.syncer.host).")
flags.DEFINE_integer("port", -1, "Port (default: config.decoupled.syncer.port; 0: any free).")
flags.DEFINE_string("port_file", "", "Write the bound port here once serving.")
flags.DEFINE_integer("shard", 0, "This shard's index in [0, decoupled.syncer.shards).")
flags.DEFINE_string(
    "checkpoint_dir", "", "Commit the state here and resume from it (empty: in memory)."
)
flags.DEFINE_integer(
    "metrics_port",
    -1,
    "Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free; -1: off).",
)
flags.DEFINE_string("metrics_host", "127.0.0.1", "Interface the metrics bind (default: loopback).")
flags.DEFINE_string("metrics_port_file", "", "Write the metrics' bound port here.")
flags.DEFINE_string(
    "debug_pause_in_merge", "", "Tests: N:PATH stops the N-th merge halfway and writes PATH."
)


def main(argv: list[str]) -> None:
    """Runs a syncer until SIGTERM/SIGINT."""
    del argv
    values = flags.FLAGS
    if not values["verbosity"].present:  # Orbax logs every commit at INFO
        logging.set_verbosity(logging.WARNING)
    runtime.host_cpu_only()  # no device code: never an accelerator's memory
    runtime.use_compile_cache()
    runtime.tune_malloc()  # before the gRPC threads: see its doc
    config = config_lib.from_config_dict(values.config)
    hook = values.debug_pause_in_merge
    server = SyncerServer(
        config,
        host=values.host,
        port=values.port,
        shard=values.shard,
        checkpoint_dir=values.checkpoint_dir or None,
        merge_hook=pause_in_merge(hook) if hook else None,
    ).start()
    metrics = None
    if values.metrics_port >= 0:  # docs/operations.md
        metrics = serve_metrics(server, values.metrics_host, values.metrics_port)
        if values.metrics_port_file:
            write_port(values.metrics_port_file, metrics.port)
    if values.port_file:
        write_port(values.port_file, server.port)
    shards = config.decoupled.syncer.shards
    name = f"[syncer {server.shard}/{shards}]" if shards > 1 else "[syncer]"
    restored = (
        f"; resumed from commit {server.restored_step} at versions {server.state.versions()}"
        if server.restored_step
        else ""
    )
    print(
        f"{name} listening on {values.host or config.decoupled.syncer.host}:{server.port}; "
        f"fragments {sorted(server.state.owned)} of {len(server.state.fragments)}, quorum "
        f"{config.decoupled.quorum}, fingerprint {server.fingerprint}{restored}"
        + (f"; metrics at {metrics.url('/metrics')}" if metrics else ""),
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        if server.state.wal_failed:  # a restart resumes from the log as it stands
            print(
                f"[syncer] stopping: its write-ahead log failed ({server.state.wal_failed}); "
                "free the disk and start it again",
                file=sys.stderr,
                flush=True,
            )
            server.stop(grace_s=0.0)
            sys.exit(1)
    # Every wait in the handlers is bounded and ends with its call, so stopping takes about
    # the grace period; should anything hang regardless, the process still ends within 5 s.
    watchdog = threading.Timer(STOP_DEADLINE_S, lambda: os._exit(0))
    watchdog.daemon = True
    watchdog.start()
    server.stop(grace_s=1.0)
    print("[syncer] stopped", flush=True)


if __name__ == "__main__":
    runtime.die_with_parent()
    sys.exit(app.run(main))
