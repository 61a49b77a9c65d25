"""Warm standby learners: spare processes that are ready to become any learner of their mesh.

A restarted learner process spends most of its start-up on things that do not depend on which
learner it is: interpreter and imports, device set-up, the compile cache, and tracing and
loading its compiled inner step. A warm standby does all of that ahead of time, as a fleet's
hot spare host does, and then waits to be told who it is:

  python -m decoupled_diloco.learner --standby=DIR --config=CONFIG --mesh_shape=1x1

It builds the `Island` of its mesh shape, runs one inner step on a real batch (compiling the
step, or loading it from the persistent cache) and discards the result, writes `DIR/ready`,
and blocks until `DIR/activate.json` appears. That file (written atomically: a temporary file
renamed into place) holds the flags of the learner it becomes (`--learner_id`, `--syncer`,
`--summary`, `--workdir`, the same `--config`), the environment that differs per learner (its
fault controls) and the log file to continue in. From then on it runs exactly as
`python -m decoupled_diloco.learner` with those flags does (restore the checkpoint, rejoin,
train), on the prebuilt island, whose jitted step is reused without tracing again.

Why a file and not a line on stdin: the supervisor starts spares like every other child
(`local.procs.Processes`: log file, environment, `die_with_parent`), with nothing held open per
child; an activation can be written by hand or by another manager; and the spare's directory
shows its state (`ready`, `activate.json`). Polling costs one `stat` every 10 ms.

A spare that is never activated exits with status 0 on SIGTERM (also sent when its parent
dies, see `runtime.die_with_parent`); before `serve` runs (during its imports) SIGTERM's default
action ends it, which leaves nothing behind either.

`Spares` is the supervisor's side (`supervisor.Supervisor.spares`, `config.supervisor.standby`):
it keeps `standby` spares per mesh shape, activates one when a killed learner's repair is
over, and starts the replacement once no learner is starting, so that a spare's warm-up never
competes with a learner's restart for the CPU. Spares write no timeline: their warm-up is
spare capacity, billed to no learner; a restarted learner's `starting` begins at activation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import runtime
from decoupled_diloco.comm.wire import TOKEN_ENV

READY = "ready"  # written by a spare once it is warm: {"process_start": t, "ready": t}
ACTIVATE = "activate.json"  # written by whoever activates it (see the module doc)
_POLL_S = 0.01


@dataclasses.dataclass
class Warm:
    """What a warm standby hands to `learner.cli.main`: its island and its start-up times."""

    island: Any  # island.Island, its step compiled
    startup: dict[str, float]


# The spare process ----------------------------------------------------------------------------


def warm_up(config: Any, shape: tuple[int, int]) -> Any:
    """Builds the island of `shape` and runs (then discards) one inner step; returns the island.

    The step is compiled here (or loaded from the persistent compile cache): a learner that
    then steps on this island with the same shapes and shardings reuses it without tracing.
    """
    import jax

    from decoupled_diloco.data.dataset import load_dataset
    from decoupled_diloco.island import Island

    island = Island(config, jax.devices()[: shape[0] * shape[1]], mesh_shape=shape)
    dataset = load_dataset(config, task=island.task)
    batches = dataset.train_iterator(config.data.batch_size, 0, config.num_learners, config.seed)
    state, loss = island.step(island.init(config.seed), next(batches))
    jax.block_until_ready((state, loss))
    return island


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name=VALUE` in `argv` (the last one), or None."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def _check_activation(
    activation: dict[str, Any], own_argv: Sequence[str], config: Any, shape: tuple[int, int]
) -> list[str]:
    """The activation's learner flags, without the config ones (which must be the spare's).

    Raises:
      ValueError: the activation names another config, several processes, or a learner whose
        mesh is not this spare's.
    """
    from decoupled_diloco.config import mesh_shape_for

    argv = [str(a) for a in activation.get("argv", [])]
    theirs = sorted(a for a in argv if a.startswith("--config"))
    ours = sorted(a for a in own_argv if a.startswith("--config"))
    if theirs != ours:
        raise ValueError(f"standby: activation config {theirs} is not this spare's {ours}")
    if int(_flag(argv, "num_processes") or 1) != 1 or _flag(argv, "standby"):
        raise ValueError("standby: a spare becomes a single-process learner, not " + str(argv))
    learner = int(_flag(argv, "learner_id") or 0)
    wanted = mesh_shape_for(config, learner, _flag(argv, "mesh_shape") or "")
    if wanted != tuple(shape):
        raise ValueError(
            f"standby: learner {learner} needs mesh {wanted}, this spare has {tuple(shape)}"
        )
    return [a for a in argv if not a.startswith("--config")]


def _continue_log_in(path: str) -> None:
    """Sends this process's stdout and stderr to `path` (appended) from now on."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(
    directory: str | pathlib.Path,
    config: Any,
    shape: tuple[int, int],
    main: Callable[..., None],
) -> None:
    """Runs a warm standby (see the module doc): warms up, waits, then runs `main` as a learner.

    Args:
      directory: where `ready` is written and `activate.json` is awaited.
      config: the experiment config (`--config`).
      shape: the island's mesh shape (`--mesh_shape`).
      main: `learner.cli.main`, called as `main(argv, warm=Warm(...))` once the activation's
        flags are parsed into `absl.flags.FLAGS`.
    """
    from absl import flags

    # Spare capacity holds nothing worth saving: leave at once when told to (or orphaned).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    started = runtime.process_start_time()
    island = warm_up(config, shape)
    ready = time.time()
    tmp = directory / (READY + ".tmp")
    tmp.write_text(json.dumps({"process_start": started, "ready": ready}))
    tmp.replace(directory / READY)
    print(f"[standby] warm in {ready - started:.2f} s ({shape[0]}x{shape[1]})", flush=True)
    path = directory / ACTIVATE
    while not path.exists():
        time.sleep(_POLL_S)
    activated_seen = time.time()
    activation = json.loads(path.read_text())
    # From here on it is a learner: SIGTERM ends it as it ends a learner started fresh.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    activated = min(float(activation.get("time", activated_seen)), activated_seen)
    argv = _check_activation(activation, sys.argv, config, shape)
    print(f"[standby] activated: {' '.join(argv)}", flush=True)
    if activation.get("log"):
        _continue_log_in(activation["log"])
    os.environ.update({str(k): str(v) for k, v in activation.get("env", {}).items()})
    flags.FLAGS([sys.argv[0], *argv])
    startup = {"activated": activated, "standby_ready": ready}
    main([sys.argv[0]], warm=Warm(island, startup))
    # The real steps must have reused the step compiled during the warm-up.
    print(f"[standby] inner step traced {island.trace_count} time(s) in this process", flush=True)


# The supervisor's side -----------------------------------------------------------------------


@dataclasses.dataclass
class Spare:
    """One spare process: its name (in `Processes`), folder, mesh shape and process."""

    name: str
    directory: pathlib.Path
    shape: tuple[int, int]
    proc: subprocess.Popen

    @property
    def ready(self) -> bool:
        """Whether it has warmed up."""
        return (self.directory / READY).exists()


def _stepped_since(path: pathlib.Path, t: float) -> bool:
    """Whether the timeline at `path` has a `stepping` or `done` record at or after `t`."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("t", 0) < t:
            return False
        if record.get("state") in ("stepping", "done"):
            return True
    return False


class Spares:
    """Warm spare learner processes, `count` per mesh shape (see the module doc).

    Not thread-safe: the supervisor calls it under its lock.

    Args:
      procs: where spares are started (`local.procs.Processes`).
      directory: the spares' folders (emptied first).
      config_file: the run's config file (a spare's `--config`).
      shapes: each learner's mesh shape, by learner id.
      count: spares kept per shape.
      timeline_dir: the learners' timelines, to see when a (re)started learner has stepped;
        None: spares are started at once.
    """

    def __init__(
        self,
        procs: Any,
        directory: pathlib.Path,
        config_file: pathlib.Path,
        shapes: Sequence[tuple[int, int]],
        count: int,
        timeline_dir: pathlib.Path | None = None,
    ):
        import shutil

        if count < 1:
            raise ValueError(f"standby: count must be >= 1, got {count}")
        self.procs, self.directory, self.count = procs, pathlib.Path(directory), count
        self.config_file, self.timeline_dir = pathlib.Path(config_file), timeline_dir
        self.shapes = [tuple(s) for s in shapes]
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)
        self.pool: dict[tuple[int, int], list[Spare]] = {s: [] for s in dict.fromkeys(self.shapes)}
        self.starting: dict[str, float] = {}  # a learner child's name -> when it was (re)started
        self.started = self.activated = 0

    def note_start(self, name: str) -> None:
        """Records that learner child `name` was (re)started now: no spare starts until it steps."""
        self.starting[name] = time.time()

    def quiet(self) -> bool:
        """Whether every (re)started learner has stepped since (its timeline says so)."""
        if self.timeline_dir is not None:
            for name, t in list(self.starting.items()):
                if _stepped_since(self.timeline_dir / f"{name}.jsonl", t):
                    del self.starting[name]
        return self.timeline_dir is None or not self.starting

    def start(self, shape: tuple[int, int]) -> Spare:
        """Starts one spare of `shape` now."""
        name = f"standby_{shape[0]}x{shape[1]}_{self.started}"
        self.started += 1
        directory = self.directory / name
        command = [
            sys.executable,
            "-m",
            "decoupled_diloco.learner",
            f"--config={self.config_file}",
            f"--standby={directory}",
            f"--mesh_shape={shape[0]}x{shape[1]}",
        ]
        with warnings.catch_warnings():
            # JAX warns on every fork of a process that imported it; the child execs at once.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            # No secret until it knows which learner it becomes: its activation brings that
            # learner's own credential (`comm.auth`).
            proc = self.procs.start(name, command, {TOKEN_ENV: ""})
        spare = Spare(name, directory, shape, proc)
        self.pool[shape].append(spare)
        return spare

    def poll(self) -> str | None:
        """Starts missing spares when no learner is starting; returns an error for a dead spare."""
        for spares in self.pool.values():
            for spare in spares:
                code = spare.proc.poll()
                if code is not None:
                    return (
                        f"{spare.name} (a warm standby) exited with code {code}:\n"
                        f"{self.procs.tail(spare.name)}"
                    )
        if any(len(s) < self.count for s in self.pool.values()) and self.quiet():
            for shape, spares in self.pool.items():
                while len(spares) < self.count:
                    self.start(shape)
        return None

    def activate(
        self, name: str, command: Sequence[str], learners: Sequence[int], env: dict[str, str]
    ) -> subprocess.Popen | None:
        """Turns a spare into learner child `name` running `command`; None if there is none.

        Only a single-process learner (`python -m decoupled_diloco.learner --learner_id=I`) can
        be a spare; a ready spare is preferred, else the one started first (further along its
        warm-up than a new process would be). The spare continues in `name`'s log and takes its
        place in `procs`.
        """
        command = list(command)
        if (
            len(learners) != 1
            or command[1:3] != ["-m", "decoupled_diloco.learner"]
            or int(_flag(command, "num_processes") or 1) != 1
            or learners[0] >= len(self.shapes)
        ):
            return None
        spares = [s for s in self.pool[self.shapes[learners[0]]] if s.proc.poll() is None]
        if not spares:
            return None
        spare = next((s for s in spares if s.ready), spares[0])
        self.pool[spare.shape].remove(spare)
        activation = {
            "argv": command[3:],
            # The learner's own secret (its credential), else the one all children share.
            "env": {TOKEN_ENV: self.procs.env.get(TOKEN_ENV, ""), **env},
            "log": str(self.procs.log_dir / f"{name}.log"),
            "time": time.time(),
        }
        tmp = spare.directory / (ACTIVATE + ".tmp")
        spare.directory.mkdir(parents=True, exist_ok=True)
        # Owner-only: it carries the learner's credential.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(activation))
        tmp.replace(spare.directory / ACTIVATE)
        del self.procs.procs[spare.name]
        self.procs.procs[name] = spare.proc
        self.activated += 1
        return spare.proc
