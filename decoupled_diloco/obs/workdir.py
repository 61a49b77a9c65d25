"""One run per workdir: the config a workdir's run trained, and a refusal to mix in another.

A workdir holds one run's metrics, TensorBoard curves, checkpoints and summary. Starting a run
of another config there (another model, mode, optimizer, data, ...) would resume the old run's
checkpoints into it or interleave two runs' curves, so it is refused, naming what differs.
What only changes how a run goes (its step budget, logging, evaluation cadence, checkpoints,
faults, monitoring, the data's location on disk) may change between a run and its resumption.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from decoupled_diloco.config import ConfigError, ExperimentConfig

RUN_STAMP = "run.json"
# The fields that say what is trained; the others may change when a run is resumed.
_TRAINED = ("mode", "num_learners", "inner_steps", "seed", "task", "model", "data", "optim")
_TRAINED += ("outer", "moe", "compression")
_MOVABLE = {"data.path"}  # the data's identity is checked apart (`dataset.check_workdir_data`)


def trained_fields(config: ExperimentConfig) -> dict[str, Any]:
    """The config's fields that say what is trained, flattened to dotted names."""
    values = dataclasses.asdict(config)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif prefix not in _MOVABLE:
            flat[prefix] = list(value) if isinstance(value, tuple) else value

    for name in _TRAINED:
        walk(name, values[name])
    return flat


def check_workdir_run(config: ExperimentConfig, workdir: pathlib.Path) -> None:
    """Refuses a run of another config in a workdir that holds a run; records this run's.

    Raises:
      ConfigError: `workdir` holds a run (a summary or checkpoints) of a config that differs
        in what is trained; the message names the fields.
    """
    stamp = workdir / RUN_STAMP
    mine = trained_fields(config)
    if stamp.is_file() and _holds_a_run(workdir):
        saved = json.loads(stamp.read_text())
        changed = [k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
        if changed:
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in changed[:6])
            more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
            raise ConfigError(
                f"workdir {workdir} holds a run of another config ({shown}{more}); a run there "
                "would mix the two runs' checkpoints, metrics and curves. Use another --workdir, "
                f"or remove {workdir} to start over"
            )
    workdir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(mine, sort_keys=True) + "\n")


def _holds_a_run(workdir: pathlib.Path) -> bool:
    checkpoints = workdir / "checkpoints"
    started = checkpoints.is_dir() and any(checkpoints.iterdir())
    return started or (workdir / "summary.json").is_file()
