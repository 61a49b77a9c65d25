"""A syncer process for benchmarks that talk to it themselves, started as an operator does.

`python -m decoupled_diloco.syncer` with the launcher's own command line
(`local.commands.syncer_command`) and environment (`local.commands.child_env`), its log in the
benchmark's directory, the port it bound read from its `--port_file`; the process is reaped
when the `with` block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence

from decoupled_diloco import config as config_lib
from decoupled_diloco.local import commands
from decoupled_diloco.local.procs import Processes


@dataclasses.dataclass
class Syncer:
    """A serving syncer process.

    Attributes:
      proc: the process (its pid for memory readings; terminate it to time a shutdown).
      port: the port it bound on 127.0.0.1.
      log: its stdout and stderr.
    """

    proc: subprocess.Popen
    port: int
    log: pathlib.Path

    @property
    def address(self) -> str:
        """host:port for clients."""
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def serving(
    config: config_lib.ExperimentConfig | pathlib.Path,
    directory: pathlib.Path,
    token: str,
    durable: bool = False,
    flags: Sequence[str] = (),
    env: Mapping[str, str] = (),
    cpu: int | None = None,
    timeout_s: float = 300.0,
    cleanup: bool = False,
) -> Iterator[Syncer]:
    """Starts a syncer, yields it once it serves, and reaps it at the end.

    Args:
      config: the run's config, or a config file.
      directory: where its config file, port file, log (and checkpoints) go.
      token: the run token (`DD_RUN_TOKEN`).
      durable: commit its state under `directory/ckpt` (write-ahead log and snapshots).
      flags: more command-line flags (e.g. `--config.KEY=VALUE` for a config file).
      env: environment variables added to the launcher's child environment.
      cpu: pin it to this core (`taskset`), apart from the benchmark's own loop.
      timeout_s: how long it may take to serve.
      cleanup: remove `directory` at the end (after the process is reaped).

    Raises:
      RuntimeError: it exited before serving (the tail of its log is in the message).
      TimeoutError: it did not serve within `timeout_s`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(config, config_lib.ExperimentConfig):
        config = config_lib.write_config_file(config, directory / "config.py")
    port_file = directory / "syncer.port"
    port_file.unlink(missing_ok=True)
    checkpoints = directory / "ckpt" if durable else None
    command = [*commands.syncer_command(config, port_file, checkpoint_dir=checkpoints), *flags]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    procs = Processes(directory, {**commands.child_env(token), **dict(env)})
    proc = procs.start("syncer", command)
    try:
        port = procs.wait_for_port(port_file, timeout_s)
        yield Syncer(proc, port, directory / "syncer.log")
    finally:
        procs.reap()
        if cleanup:
            shutil.rmtree(directory, ignore_errors=True)
