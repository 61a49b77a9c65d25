"""`train_and_evaluate`: the library entry point behind `python -m experiments.train`.

It validates the config and the workdir, then runs the mode: `decoupled` as a syncer and
learner processes (`local.launch`); `dp`/`diloco` in this process (`local.in_process`: data
shards, trainer, resume, step loop, evaluation, `metrics.jsonl` and `summary.json`), or under
faults in a supervised child process that does the same (`local.synchronous`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import optax

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime, tasks
from decoupled_diloco.local.in_process import InProcessRun, build_trainer
from decoupled_diloco.obs import workdir as workdir_lib
from decoupled_diloco.obs.writers import MetricWriter

Params = Any


@dataclasses.dataclass
class RunResult:
    """What a run returns to its caller (the same numbers are in `summary.json`)."""

    summary: dict[str, Any]
    params: Params
    # `monitor.enabled` (decoupled): the job page, still serving the final state; `stop()` it
    # when done (`experiments.train` does once the report is written).
    monitor: Any = None


def _user_task(
    config: config_lib.ExperimentConfig,
    task: tasks.Task | None,
    inner_optimizer: optax.GradientTransformation | None,
    dataset: Any,
) -> tuple[config_lib.ExperimentConfig, tasks.Task]:
    """The run's config and task: a task given here travels to other processes by import path.

    Raises:
      ConfigError: in a mode that starts processes (decoupled, or under faults), a task
        without an import path, or a dataset or optimizer given only as a Python object.
    """
    builtin = task is not None and task.import_path.startswith("builtin:")  # from config.model
    if task is not None and task.import_path and not builtin:
        config = config_lib.replace(config, task=task.import_path)
    processes = config.mode == "decoupled" or bool(config.chaos)
    if processes and task is not None and not config.task and not builtin:
        raise config_lib.ConfigError(
            f"train_and_evaluate(task=...): mode {config.mode!r}"
            f"{' under faults' if config.chaos else ''} starts processes that must build the "
            "same task, and this one has no import path; put a function `make_task(config) -> "
            "dd.Task` in an importable module and pass config.task='mypkg.tasks:make_task' "
            "(or Task.from_nnx(..., import_path='mypkg.tasks:make_task'))"
        )
    if processes and (inner_optimizer is not None or dataset is not None):
        raise config_lib.ConfigError(
            f"train_and_evaluate: mode {config.mode!r}"
            f"{' under faults' if config.chaos else ''} starts processes, which cannot receive "
            "Python objects: give the dataset and the inner optimizer to the task that "
            "config.task builds (Task.from_nnx(..., dataset=..., inner_optimizer=...))"
        )
    config_lib.validate(config)
    task = task or tasks.make_task(config)
    if inner_optimizer is not None:
        task = dataclasses.replace(task, inner_optimizer=inner_optimizer)
    if dataset is not None:
        task = dataclasses.replace(task, dataset=dataset)
    return config, task


def _default_devices(config: config_lib.ExperimentConfig) -> list[jax.Device]:
    """Every device; on CPU before JAX starts, first as many fake ones as the learners need."""
    needed = config.num_learners * config.devices_per_learner
    if not runtime.jax_started():
        runtime.configure_cpu_devices(needed)
    devices = jax.devices()
    if len(devices) < needed and devices[0].platform == "cpu":
        raise config_lib.ConfigError(
            f"num_learners: {config.num_learners} learners x mesh.shape {config.mesh.shape} "
            f"need {needed} CPU devices, but JAX already started in this process with "
            f"{len(devices)}, and XLA_FLAGS cannot change that now: restart the Python session "
            f"(in a notebook, the kernel) and call dd.configure_cpu_devices({needed}) before "
            "anything uses JAX, or pass devices= (a learner per slice of them)"
        )
    return devices


def train_and_evaluate(
    config: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path | None,
    devices: Sequence[jax.Device] | None = None,
    stop_after: int | None = None,
    corpus: Any = None,
    supervised_controls: Sequence[Any] | None = None,
    *,
    task: tasks.Task | None = None,
    inner_optimizer: optax.GradientTransformation | None = None,
    dataset: Any = None,
    writers: Sequence[MetricWriter] = (),
) -> RunResult:
    """Trains `config` in `workdir`, resuming from its newest readable checkpoint.

    Any model trains, in every mode (docs/byom.md):

        task = dd.Task.from_nnx(build_model=lambda rngs: CNN(rngs=rngs), loss_fn=my_loss)
        dd.train_and_evaluate(config, workdir, task=task, inner_optimizer=tx, dataset=data)

    Args:
      config: the experiment; validated (including the device count) before anything compiles.
      workdir: where metrics, summary and checkpoints go; None keeps everything in memory.
      devices: devices to use (default: all; on CPU, when JAX has not started yet in this
        process, as many fake devices as the learners need are made first); learner i gets
        the i-th slice.
      stop_after: stop (with a checkpoint) after this global step, as a preemption would.
      corpus: pre-loaded data, a text corpus or an image set (default: load `config.data`).
      supervised_controls: set in the child process a fault supervisor runs (see
        `local.synchronous.run_synchronous`): each learner's live fault controls. None: this
        process supervises itself when `config.chaos` names a schedule.
      task: what is trained (`dd.Task`; default: `config.task`'s, or the built-in model of
        `config.model.kind`). In decoupled mode it must have an import path.
      inner_optimizer: any optax `GradientTransformation` (default: the task's, else
        `config.optim`'s); in one process only.
      dataset: a `data.dataset.Dataset` (default: the task's, else `config.data`'s); in one
        process only.
      writers: metric writers of the user's own (`write_scalars(step, scalars)`, `flush()`,
        `close()`: a `clu.metric_writers` writer, say) beside those `config.metrics.writers`
        names; they get the same names (`obs.writers`) and are closed at the end. They need a
        workdir, and cannot follow a run under faults into its child process.

    Returns:
      The summary and the final global parameters (host arrays).
    """
    # Paths are the caller's: resolved here, before any child process (run from elsewhere).
    config = config_lib.absolute_paths(config)
    config, task = _user_task(config, task, inner_optimizer, dataset)
    if workdir is not None:
        workdir_lib.check_workdir_run(config, pathlib.Path(workdir))
    elif writers:
        raise config_lib.ConfigError("writers: metric writers need a workdir (got None)")
    if config.mode == "decoupled":  # Separate processes: a syncer and one per learner.
        from decoupled_diloco.local.launch import run_decoupled

        summary, params, monitor = run_decoupled(
            config, workdir, corpus=corpus, task=task, writers=writers
        )
        _keep_model(config, workdir, summary, params)
        return RunResult(summary=summary, params=params, monitor=monitor)
    devices = list(devices if devices is not None else _default_devices(config))
    config_lib.validate(config, device_count=len(devices))
    supervised = supervised_controls is not None  # the process a supervisor runs
    if config.chaos and not supervised:
        # Under faults the job runs in a child process that a fault can kill -9 (see
        # `synchronous.run_synchronous`); here we only supervise it.
        if workdir is None:
            raise config_lib.ConfigError("config.chaos: a run under faults needs a workdir")
        if writers:
            raise config_lib.ConfigError(
                "writers: a run under faults (config.chaos) trains in a child process, which "
                "objects passed here cannot follow; name the writers in config.metrics.writers"
            )
        from decoupled_diloco.local.synchronous import run_synchronous

        summary = run_synchronous(config, pathlib.Path(workdir))
        params = _final_params(config, devices, corpus, pathlib.Path(workdir), task)
        _keep_model(config, workdir, summary, params)
        return RunResult(summary=summary, params=params)
    workdir = pathlib.Path(workdir) if workdir is not None else None
    run = InProcessRun(
        config, workdir, devices, task, corpus, stop_after, supervised_controls, writers
    )
    summary, params = run.run()
    if not supervised:  # (a supervised child's parent keeps it, from the last checkpoint)
        _keep_model(config, workdir, summary, params)
    return RunResult(summary=summary, params=params)


def _keep_model(
    config: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path | None,
    summary: dict[str, Any],
    params: Params | None,
) -> None:
    """The final global model in `workdir/model/` (`decoupled_diloco.export`), for sampling."""
    stopped = config.mode != "decoupled" and summary.get("steps_done", 0) < config.train_steps
    if workdir is None or params is None or stopped:
        return  # (a run stopped early, `stop_after`, keeps its checkpoints, not a final model)
    from decoupled_diloco import export

    facts = {k: summary.get(k) for k in ("mode", "num_learners", "steps_done", "tokens")}
    facts.update({k: v for k, v in summary.items() if k.startswith("final_eval_")})
    export.save_model(pathlib.Path(workdir) / export.MODEL_DIR, params, config, facts)


def _final_params(
    config: config_lib.ExperimentConfig,
    devices: Sequence[jax.Device],
    corpus: Any,
    workdir: pathlib.Path,
    task: tasks.Task,
) -> Params | None:
    """The final global parameters of a supervised run, from its last checkpoint (if any)."""
    if not config.checkpoint.every:
        return None
    trainer = build_trainer(config, corpus, devices, workdir / "checkpoints", task=task)
    trainer.restore()
    for checkpointer in trainer.checkpointers:
        checkpointer.close()
    return jax.device_get(trainer.global_params())
