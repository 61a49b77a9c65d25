"""A training run as a child process, or the finished run of the very same config, reused.

Benchmarks and `experiments.compare` run `python -m experiments.train` as a user would. A run
is reused only when its `summary.json` records exactly the config the command resolves to
(every field, defaults included), so a changed default or a changed flag runs it again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from decoupled_diloco import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def resolve(config_file: str | pathlib.Path, overrides: Mapping[str, Any] = ()) -> Any:
    """The `ExperimentConfig` that `--config=FILE --config.KEY=VALUE ...` gives."""
    path = pathlib.Path(config_file)
    path = path if path.is_absolute() else REPO / path
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = config_lib.from_config_dict(module.get_config())
    config = config_lib.replace(config, **dict(overrides)) if overrides else config
    if config.chaos and not pathlib.Path(config.chaos).is_absolute():  # as the run records it
        config = dataclasses.replace(config, chaos=str(REPO / config.chaos))
    return config


def finished(workdir: str | pathlib.Path, config: Any) -> bool:
    """Whether `workdir` holds a finished run of exactly `config` (so it need not run again)."""
    path = pathlib.Path(workdir) / "summary.json"
    if not path.exists():
        return False
    try:
        recorded = json.loads(path.read_text()).get("config")
    except json.JSONDecodeError:
        return False
    return recorded == json.loads(json.dumps(dataclasses.asdict(config)))  # tuples -> lists


def command(
    config_file: str | pathlib.Path, overrides: Mapping[str, Any], workdir: str | pathlib.Path
) -> list[str]:
    """The training command line."""
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    return [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config={config_file}",
        f"--workdir={workdir}",
        *flags,
    ]


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it: `python`, paths relative to the repository."""
    return shlex.join(["python", *(x.replace(f"{REPO}/", "") for x in cmd[1:])])


def run_or_reuse(
    config_file: str | pathlib.Path,
    overrides: Mapping[str, Any],
    workdir: str | pathlib.Path,
    rerun: bool = False,
    quiet: bool = True,
    tag: str = "runs",
    cap_s: float | None = None,
    env: Mapping[str, str] = (),
) -> dict[str, Any] | None:
    """Trains `config_file` with `overrides` in `workdir`, unless it already holds that run.

    A workdir holding anything else (another config's run, or a run that was stopped) is
    emptied first: the new run resumes no checkpoint of it. With `cap_s`, a run still going
    after that many seconds is killed with its whole process group (a fault benchmark's
    window: what it did so far is in its timeline) and None is returned.

    Args:
      config_file: a config file (`get_config()`), relative to the repository or absolute.
      overrides: `--config.KEY=VALUE` overrides, by dotted key.
      workdir: the run's directory.
      rerun: train even where a finished run of the same config is there.
      quiet: send the run's output to `workdir/train.log` instead of this terminal.
      tag: the prefix of the progress line printed for each run.
      cap_s: stop the run after this many seconds (None: let it finish).
      env: environment variables added to the run's.

    Returns:
      The run's summary, with the command that produced it (`command`); None for a run
      stopped at `cap_s`.

    Raises:
      subprocess.CalledProcessError: the run failed (its output is in `workdir/train.log`).
    """
    workdir = pathlib.Path(workdir)
    config = resolve(config_file, overrides)
    cmd = command(config_file, overrides, workdir)
    reuse = not rerun and finished(workdir, config)
    print(f"[{tag}]", "reusing" if reuse else "running", shown(cmd), flush=True)
    if not reuse:
        # A stopped or older run's checkpoints would be resumed: a cell starts from nothing.
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True, exist_ok=True)
        child_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | dict(env)
        child_env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "jax"))
        with (workdir / "train.log").open("w") as log:
            out = log if quiet else None
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=child_env, stdout=out, stderr=out, start_new_session=True
            )
            try:
                code = proc.wait(timeout=cap_s)
            except subprocess.TimeoutExpired:  # its window is over: the run and its children
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None
            except BaseException:  # stopped (a signal made SystemExit, Ctrl+C): stop it too
                _stop(proc)
                raise
            if code:
                raise subprocess.CalledProcessError(code, cmd)
    summary = json.loads((workdir / "summary.json").read_text())
    summary["command"] = shown(cmd)
    return summary


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stops a run: SIGTERM, then SIGKILL if it has not ended within `grace_s`.

    SIGTERM first, so that the launcher tears down what it made (processes, namespaces).
    """
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
