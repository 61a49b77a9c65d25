"""Child processes of a launcher: started with their logs, free ports, reaped at the end."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time
from collections.abc import Sequence

from decoupled_diloco.runtime import PARENT_PID_ENV

# Children run from the repository root, so that `-m decoupled_diloco...` and relative config
# paths resolve as they do for the launcher's own command line.
_REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (prefer binding port 0 where the server allows it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reap(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminates every process still running, waits `grace_s`, then kills the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Processes:
    """Children started with their output in log files; `reap()` ends all of them."""

    def __init__(self, log_dir: pathlib.Path, env: dict[str, str]):
        self.log_dir, self.env = log_dir, env
        self.procs: dict[str, subprocess.Popen] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Starts one child, with `env` added to the common environment.

        Its stdout and stderr go to `log_dir/NAME.log`. The child follows its parent's death by
        calling `runtime.die_with_parent` itself (no `preexec_fn`: see there why).
        """
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
                cwd=_REPO,
            )
        self.procs[name] = proc
        return proc

    def failed(self) -> dict[str, int]:
        """Children that exited with a non-zero code."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a child's log."""
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def wait_for_port(self, port_file: pathlib.Path, timeout_s: float) -> int:
        """The port a child writes to `port_file` once serving (the syncer's `--port_file`).

        Raises:
          RuntimeError: a child exited with an error first (its log's tail is in the message).
          TimeoutError: no port within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_file.exists() and port_file.read_text().strip():
                return int(port_file.read_text())
            if self.failed():
                name = sorted(self.failed())[0]
                raise RuntimeError(f"{name} exited early:\n{self.tail(name)}")
            time.sleep(0.05)
        raise TimeoutError(f"no port in {port_file} within {timeout_s:.0f}s")

    def reap(self) -> None:
        """Terminates and reaps every child."""
        reap(list(self.procs.values()))
