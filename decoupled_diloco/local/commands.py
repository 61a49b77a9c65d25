"""The command lines and environment of the local launcher's children.

Exactly what a user would run by hand on separate hosts: `python -m decoupled_diloco.syncer
...` per shard, `python -m decoupled_diloco.learner ...` per island process (`local.launch`
starts them, `local.wan` wraps them where a WAN is emulated).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from collections.abc import Sequence

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm import wire
from decoupled_diloco.local.procs import free_port
from decoupled_diloco.obs import monitor as monitor_lib


def child_env(token: str) -> dict[str, str]:
    """A child's environment: the run token, without an inherited fake-device count.

    Each learner then fakes exactly the devices its own mesh needs; on accelerators the
    children allocate memory on demand (`runtime.share_accelerators`), since they share a
    host's devices.
    """
    env = dict(os.environ)
    env[wire.TOKEN_ENV] = token
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env


def metrics_flags(
    workdir: pathlib.Path, name: str, config: config_lib.ExperimentConfig, urls: dict[str, str]
) -> list[str]:
    """Process `name`'s metrics flags under `monitor.enabled` (else none); its URL into `urls`.

    A fixed free port (a restart comes back on it), written to `workdir/NAME.metrics.port`
    once serving.
    """
    if not config.monitor.enabled:
        return []
    port_file = workdir / f"{name}{monitor_lib.PORT_SUFFIX}"
    port_file.unlink(missing_ok=True)
    host = config.monitor.host
    port = free_port(host)
    urls[name] = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/metrics"
    return [
        f"--metrics_port={port}",
        f"--metrics_host={host}",
        f"--metrics_port_file={port_file}",
    ]


def syncer_command(
    config_file: pathlib.Path,
    port_file: pathlib.Path,
    port: int = 0,
    shard: int = 0,
    checkpoint_dir: pathlib.Path | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """A syncer shard's command line (on `host`; the bound port is written to `port_file`).

    A fixed `port` lets a restarted syncer come back where its learners look for it; with
    `checkpoint_dir` it commits its state there and resumes from it (`syncer.durability`).
    """
    command = [
        sys.executable,
        "-m",
        "decoupled_diloco.syncer",
        f"--config={config_file}",
        f"--host={host}",
        f"--port={port}",
        f"--port_file={port_file}",
        f"--shard={shard}",
    ]
    return command + ([f"--checkpoint_dir={checkpoint_dir}"] if checkpoint_dir else [])


def learner_command(
    config_file: pathlib.Path, address: str, learner_id: int, summary: pathlib.Path
) -> list[str]:
    """Learner `learner_id`'s command line; its checkpoints go under the summary's folder."""
    return [
        sys.executable,
        "-m",
        "decoupled_diloco.learner",
        f"--config={config_file}",
        f"--syncer={address}",
        f"--learner_id={learner_id}",
        f"--summary={summary}",
        f"--workdir={summary.parent}",
    ]


def island_commands(
    config: config_lib.ExperimentConfig,
    config_file: pathlib.Path,
    address: str | Sequence[str],
    learner_id: int,
    summary: pathlib.Path,
    coordinator_host: str = "127.0.0.1",
) -> list[tuple[str, list[str]]]:
    """(name, command) of each process of learner `learner_id`'s island.

    One process (`learner_I`) unless `decoupled.island_processes` > 1: then P processes form
    one JAX runtime (`multihost`) with process 0 (`learner_I`, the leader) as coordinator on a
    free port of `coordinator_host`; the others are `learner_I_pJ` and write
    `learner_I_pJ.json`. `address` is the syncer's, or one per process (each from its site).
    """
    num = config.decoupled.island_processes
    addresses = [address] * num if isinstance(address, str) else list(address)
    if num == 1:
        command = learner_command(config_file, addresses[0], learner_id, summary)
        return [(f"learner_{learner_id}", command)]

    coordinator = f"{coordinator_host}:{free_port()}"
    out = []
    for j in range(num):
        name = f"learner_{learner_id}" + (f"_p{j}" if j else "")
        base = learner_command(config_file, addresses[j], learner_id, summary)
        command = [x for x in base if not x.startswith("--summary=")]
        command += [
            f"--summary={summary.with_name(name + '.json')}",
            f"--coordinator={coordinator}",
            f"--num_processes={num}",
            f"--process_id={j}",
        ]
        out.append((name, command))
    return out
