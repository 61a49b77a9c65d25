"""Metric writers: every metrics event as named scalars, to TensorBoard, W&B or a JSONL file.

One small interface, the one `clu.metric_writers` uses (`write_scalars(step, scalars)`,
`flush()`, `close()`), so a writer of a user's own (a `clu` writer included) is passed as is:
`train_and_evaluate(config, workdir, writers=[...])`. `metrics.writers` picks the built-in ones
by name; `workdir/metrics.jsonl`, the run's own record, is always written beside them.

Every writer gets the same names, made from an event by `event_scalars`:

- one write per event at its `step`: each numeric value under its key (`loss`, `eval_loss`,
  `tokens`, `outer_syncs`, ...), each list item as `KEY/I` (`learner_losses` ->
  `learner_loss/0`), each dict entry as `KEY/NAME`;
- in decoupled mode, one more write per learner at that learner's own step: its `learner_*`
  values as `learner_I/NAME` (`learner_0/loss`, `learner_0/bytes_sent`).

Strings, nulls and non-finite values are left out. TensorBoard shows `learner_I/NAME` as the
series `NAME` of the run `learner_I` (so the learners overlay); W&B plots it against
`learner_I/step`, everything else against `step`; `scalars.jsonl` holds one line per write.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from decoupled_diloco import config as config_lib
from decoupled_diloco.config import ConfigError

LEARNER_SERIES = re.compile(r"^(learner_\d+)/(.+)$")  # learner_I/NAME: learner I's own step
_AXES = {"step", "wall_s"}  # the x axes, not series


class MetricWriter(Protocol):
    """What a writer does (`clu.metric_writers.MetricWriter`'s scalar part)."""

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Writes `scalars` at `step`."""

    def flush(self) -> None:
        """Makes what was written durable or visible."""

    def close(self) -> None:
        """Flushes and releases the writer."""


def event_scalars(event: Mapping[str, Any]) -> list[tuple[int, dict[str, float]]]:
    """One metrics event as `(step, {name: value})` writes (names: see the module docstring)."""
    step = int(event.get("step") or 0)
    learner_steps = event.get("learner_steps")
    decoupled = isinstance(learner_steps, list)
    main: dict[str, float] = {}
    own: dict[int, dict[str, float]] = {}
    for key, value in event.items():
        if key in _AXES:
            continue
        if isinstance(value, list):
            if decoupled and key.startswith("learner_"):
                if key == "learner_steps":
                    continue
                name = _singular(key[len("learner_") :])  # learner_losses -> learner_I/loss
                for i, x in enumerate(value):
                    if _finite(x):
                        own.setdefault(i, {})[f"learner_{i}/{name}"] = float(x)
            else:
                name = _singular(key)  # learner_losses -> learner_loss/I
                main.update({f"{name}/{i}": float(x) for i, x in enumerate(value) if _finite(x)})
        elif isinstance(value, dict):
            main.update({f"{key}/{n}": float(x) for n, x in value.items() if _finite(x)})
        elif _finite(value):
            main[key] = float(value)
    writes = [(step, main)] if main else []
    for i, scalars in sorted(own.items()):
        writes.append((int(learner_steps[i] or 0) if i < len(learner_steps) else step, scalars))
    return writes


def open_resumed(path: pathlib.Path, resume_step: int) -> Any:
    """`path` (JSON lines with a "step") opened for appending, lines after `resume_step` dropped.

    A resumed run logs those steps again; a fresh one (0) keeps only what is before its first
    step. Lines that do not parse (cut short by a crash) are dropped too. Append mode: other
    writers (the chaos supervisor's events in `metrics.jsonl`) may add lines to the same file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= resume_step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, AttributeError):
                continue
    path.write_text("".join(kept))
    return path.open("a")


def close_within(close: Any, timeout_s: float, what: str) -> None:
    """Calls `close()` on a thread, waiting at most `timeout_s`; says so if it is not done.

    A writer's close can hang on its own background thread (tensorboardX after a Ctrl+C, a W&B
    upload behind a dead link): the run still ends, missing at most the last values.
    """
    closer = threading.Thread(target=close, name=f"close-{what}", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        print(f"[metrics] {what} not closed within {timeout_s:g} s", flush=True)


class JsonlWriter:
    """One JSON line per write, `{"step": S, NAME: VALUE, ...}`, flushed at once.

    Args:
      path: the file (`workdir/scalars.jsonl`).
      resume_step: lines after this step, written before a restart, are dropped.
    """

    def __init__(self, path: str | pathlib.Path, resume_step: int = 0):
        self.path = pathlib.Path(path)
        self._file = open_resumed(self.path, resume_step)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Appends one line."""
        self._file.write(json.dumps({"step": int(step), **scalars}) + "\n")
        self._file.flush()

    def flush(self) -> None:
        """Lines are flushed as they are written."""
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


class WandbWriter:
    """A Weights & Biases run (`pip install 'decoupled_diloco[wandb]'`), one per job.

    `metrics.wandb_mode` "offline" writes it under `workdir/wandb` with no network (`wandb sync`
    uploads it later); "" leaves the mode to W&B (`WANDB_MODE`, else online, which needs
    `WANDB_API_KEY` or `wandb login`). The run's config is the experiment config.

    Args:
      config: the experiment config (`config.metrics` says project, entity and mode).
      workdir: the run directory; the W&B files go to `workdir/wandb`.
      resume_step: 0 starts a new W&B run; otherwise the one whose id `workdir/wandb_run_id`
        holds is resumed.
    """

    def __init__(self, config: Any, workdir: pathlib.Path, resume_step: int = 0):
        import wandb  # (`config.validate` says how to install it when it is missing)

        m = config.metrics
        id_file = workdir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step and id_file.exists() else None
        try:
            self.run = wandb.init(
                project=m.wandb_project,
                entity=m.wandb_entity or None,
                name=m.wandb_name or workdir.name,
                dir=str(workdir),
                mode=m.wandb_mode or None,
                # the experiment config, less the syncer's secret
                config=dataclasses.asdict(
                    config_lib.replace(config, **{"decoupled.syncer.token": ""})
                ),
                id=run_id,
                resume="allow",
            )
        except Exception as error:  # noqa: BLE001 - W&B's own errors, named for the user
            raise ConfigError(
                f"config.metrics.writers: W&B could not start ({error}); set WANDB_API_KEY, "
                "run `wandb login`, or use metrics.wandb_mode=offline"
            ) from error
        id_file.write_text(self.run.id + "\n")
        self._defined: set[str] = set()

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Logs one row: the values and their axis, `step` (or `learner_I/step`)."""
        row: dict[str, float] = dict(scalars)
        for name in scalars:
            match = LEARNER_SERIES.match(name)
            axis = f"{match.group(1)}/step" if match else "step"
            row[axis] = int(step)
            if name not in self._defined:
                self.run.define_metric(name, step_metric=axis)
                self._defined.add(name)
        self.run.log(row)

    def flush(self) -> None:
        """W&B sends rows on its own."""

    def close(self, timeout_s: float = 30.0) -> None:
        """Finishes the run, waiting at most `timeout_s` (a stuck upload does not hold the run)."""
        close_within(self.run.finish, timeout_s, "the W&B run")


def close_all(writers: Sequence[MetricWriter]) -> None:
    """Closes every writer; one that fails does not keep the others open."""
    errors = []
    for writer in writers:
        try:
            writer.close()
        except Exception as error:  # noqa: BLE001 - reported below, after the others
            errors.append(f"{type(writer).__name__}: {error}")
    if errors:
        print(f"[metrics] closing writers failed: {'; '.join(errors)}", flush=True)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _singular(name: str) -> str:
    if name.endswith("sses"):
        return name[:-2]
    return name[:-1] if name.endswith("s") else name
