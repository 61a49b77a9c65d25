r"""Shows a running syncer's state: `python -m decoupled_diloco.status --syncer=HOST:PORT`.

The run token comes from `DD_RUN_TOKEN` (or `--token_file`), never from the command line.
Prints learners (state, step, loss, heartbeat age, staleness, fragment versions), fragments
(version, merges, late and duplicate pushes) and the grace-window averages; `--json` prints
the raw status instead. `--watch` refreshes a live table (see `decoupled_diloco.obs.watch`) until
Ctrl+C, adding merges per minute and goodput when the syncer reports it. `--serve=PORT` serves the
live job page (`decoupled_diloco.obs.monitor`) on 127.0.0.1:PORT instead, behind the run token.
With `--workdir=RUN` of a local run, `--add_learner` starts one more learner and
`--remove_learner=ID` ends one for good (`decoupled_diloco.local.scaling`). The membership log
(joins, restarts, leaves, losses) ends the table.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import grpc
from absl import app, flags

from decoupled_diloco.comm.shards import parse_addresses, syncer_client
from decoupled_diloco.config import SyncerConfig

_SYNCER = flags.DEFINE_string(
    "syncer", "127.0.0.1:50051", "HOST:PORT of the syncer (of each shard, comma-separated)."
)
_TOKEN_FILE = flags.DEFINE_string("token_file", "", "File holding the run token.")
_WORKDIR = flags.DEFINE_string(
    "workdir", "", "A local launcher's run directory: its syncer.port and run_token, read there."
)
_TLS_CERT = flags.DEFINE_string("tls_cert", "", "PEM certificate to trust (TLS syncers).")
_JSON = flags.DEFINE_bool("json", False, "Print the raw status JSON.")
_WATCH = flags.DEFINE_bool("watch", False, "Refresh a live table until Ctrl+C.")
_INTERVAL = flags.DEFINE_float("interval", 2.0, "Seconds between refreshes with --watch.")
_COUNT = flags.DEFINE_integer("count", 0, "With --watch: stop after N refreshes (0: never).")
_SERVE = flags.DEFINE_integer(
    "serve", -1, "Serve the live job page on this port until Ctrl+C (0: any free; -1: off)."
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "With --serve: the interface to bind.")
_ADD = flags.DEFINE_bool(
    "add_learner", False, "With --workdir: start one more learner in that local run (a join)."
)
_REMOVE = flags.DEFINE_integer(
    "remove_learner", -1, "With --workdir: end learner ID of that local run for good (a leave)."
)


MEMBERSHIP_SHOWN = 5  # the last membership changes the table lists


def format_status(status: dict[str, Any]) -> str:
    """A human-readable table of a status dict."""
    lines = [
        f"{'learner':>7} {'state':>10} {'mesh':>5} {'step':>7} {'loss':>7} {'eval':>7} "
        f"{'beat_s':>7} {'stale':>5} versions"
    ]
    for i, x in status["learners"].items():
        lines.append(
            f"{i:>7} {x['state']:>10} {x['mesh']:>5} {x['step']:>7} {x['loss']:>7.3f} "
            f"{x['eval_loss']:>7.3f} {x['heartbeat_age_s']:>7.1f} {x['staleness']:>5} "
            f"{x['versions']}"
        )
    lines.append(
        f"{'fragment':>8} {'version':>7} {'merges':>6} {'late':>5} {'dup':>5} {'bytes':>10}"
    )
    for p, f in enumerate(status["fragments"]):
        lines.append(
            f"{p:>8} {f['version']:>7} {f['merges']:>6} {f['late_pushes']:>5} "
            f"{f['duplicate_pushes']:>5} {f['bytes']:>10}"
        )
    for event in status.get("membership", [])[-MEMBERSHIP_SHOWN:]:
        lines.append(
            f"membership: learner {event['learner']} {event['event']} (live {event['live']})"
        )
    ema = status["ema"]
    lines.append(
        f"merges {status['merges']}; EMA step {ema['step_s'] * 1e3:.1f} ms, quorum "
        f"{ema['quorum_s'] * 1e3:.1f} ms, sync {ema['sync_s'] * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def _shard_number(path: pathlib.Path) -> int:
    return int(path.stem.split("_")[1])


def _serve(address: str, config: SyncerConfig, token: str) -> None:
    """`--serve`: the job page (`obs.monitor`) until SIGINT or SIGTERM."""
    import signal
    import threading

    from decoupled_diloco.comm import auth
    from decoupled_diloco.obs.monitor import Monitor

    try:
        client = syncer_client(address, config, token)
        monitor = Monitor(
            client, token, _HOST.value, _SERVE.value, _WORKDIR.value or None, _INTERVAL.value,
            f"decoupled run: syncer {address}", scrape_secret=auth.scrape_secret(token),
            close_client=True,
        ).start()  # fmt: skip
    except (ValueError, RuntimeError) as error:  # no token; the port is taken
        sys.exit(str(error))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the line a caller may act on
        signal.signal(sig, lambda *_: stop.set())
    print(f"job page at {monitor.login_url()} (Ctrl+C to stop)", flush=True)
    while not stop.wait(1.0):  # (signal handlers run between the waits)
        pass
    monitor.stop()


def main(argv: list[str]) -> None:
    """Fetches and prints the status."""
    del argv
    if _ADD.value or _REMOVE.value >= 0:  # scale a local run (`local.scaling`)
        from decoupled_diloco.local import scaling

        if not _WORKDIR.value:
            sys.exit("--add_learner and --remove_learner scale a local run: give its --workdir")
        try:
            if _ADD.value:
                scaling.request(_WORKDIR.value, "join")
            if _REMOVE.value >= 0:
                scaling.request(_WORKDIR.value, "leave", _REMOVE.value)
        except ValueError as error:
            sys.exit(str(error))
        print(f"requested; the launcher logs what it did in {_WORKDIR.value}/metrics.jsonl")
        return
    address, token_file = _SYNCER.value, _TOKEN_FILE.value
    if _WORKDIR.value:  # A run started by `experiments.train` on this machine.
        workdir = pathlib.Path(_WORKDIR.value)
        port_file, token_file = workdir / "syncer.port", str(workdir / "run_token")
        if not port_file.exists() or not pathlib.Path(token_file).exists():
            sys.exit(f"{workdir}: no syncer.port or run_token; is a decoupled run going on there?")
        # Shard 0 writes syncer.port, shard s > 0 syncer_s.port (see launch._start_syncers).
        port_files = [port_file, *sorted(workdir.glob("syncer_*.port"), key=_shard_number)]
        address = ",".join(f"127.0.0.1:{f.read_text().strip()}" for f in port_files)
        if (workdir / "syncer.address").exists():  # not on loopback (`decoupled.wan_mbit`)
            address = (workdir / "syncer.address").read_text().strip()
    token = pathlib.Path(token_file).read_text().strip() if token_file else ""
    shards = len(parse_addresses(address))  # HOST:PORT,HOST:PORT...: a sharded syncer
    config = SyncerConfig(tls_cert=_TLS_CERT.value, retries=1, rpc_timeout_s=10.0, shards=shards)
    if _SERVE.value >= 0:
        _serve(address, config, token)
        return
    if _WATCH.value:
        from decoupled_diloco.obs.watch import watch

        try:
            client = syncer_client(address, config, token)
        except ValueError as error:  # no token
            sys.exit(str(error))
        watch(client, address, _INTERVAL.value, _COUNT.value)
        return
    try:
        client = syncer_client(address, config, token)
        status = client.status()
    except ValueError as error:  # no token
        sys.exit(str(error))
    except grpc.RpcError as error:
        sys.exit(f"{address}: {error.code().name}: {error.details()}")
    print(json.dumps(status, indent=2) if _JSON.value else format_status(status))


if __name__ == "__main__":
    app.run(main)
