"""`train_and_evaluate`: the library entry point behind `python -m experiments.train`.

It validates the config, builds the data shards and the trainer for the mode, resumes from
the newest readable checkpoint in `workdir`, trains with progress lines, evaluates on the
held-out batches, and writes `metrics.jsonl` and `summary.json`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime, tasks
from decoupled_diloco.core.compression import ring_allreduce_bytes
from decoupled_diloco.data import dataset as dataset_lib
from decoupled_diloco.models.transformer import count_params
from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.obs import workdir as workdir_lib
from decoupled_diloco.obs.metrics import MetricsWriter, Progress, make_writers, write_summary
from decoupled_diloco.obs.summary import RunSummary
from decoupled_diloco.obs.writers import MetricWriter
from decoupled_diloco.trainers import DataParallelTrainer, DiLoCoTrainer

TRAINERS = {"dp": DataParallelTrainer, "diloco": DiLoCoTrainer}
Params = Any


@dataclasses.dataclass
class RunResult:
    """What a run returns to its caller (the same numbers are in `summary.json`)."""

    summary: dict[str, Any]
    params: Params
    # `monitor.enabled` (decoupled): the job page, still serving the final state; `stop()` it
    # when done (`experiments.train` does once the report is written).
    monitor: Any = None


def build_trainer(
    config: config_lib.ExperimentConfig,
    dataset: Any,
    devices: Sequence[jax.Device],
    checkpoint_dir: pathlib.Path | None = None,
    controls: Sequence[Any] = (),
    task: tasks.Task | None = None,
    tx: optax.GradientTransformation | None = None,
) -> DataParallelTrainer | DiLoCoTrainer:
    """The trainer for `config.mode`, with one data shard per learner.

    Args:
      config: the experiment.
      dataset: a `data.dataset.Dataset` (or a text `Corpus` or image set; None: the task's).
      devices: every learner's devices.
      checkpoint_dir: where checkpoints go (None: none).
      controls: per learner, live fault controls (`chaos.faults.Controls`) or None.
      task: the model, loss and metrics (default: `make_task(config)`).
      tx: the inner optimizer (default: the task's, else `config.optim`'s).

    Raises:
      ConfigError: checkpoints are on and the dataset's iterators cannot be checkpointed.
    """
    task = task or tasks.make_task(config)
    dataset = dataset_lib.load_dataset(config, dataset, task)
    iterators = [
        dataset.train_iterator(config.data.batch_size, learner_id, config.num_learners, config.seed)
        for learner_id in range(config.num_learners)
    ]
    if checkpoint_dir is not None:
        dataset_lib.check_checkpointable(iterators[0], config)
    return TRAINERS[config.mode](config, devices, iterators, checkpoint_dir, controls, task, tx)


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
        return RunResult(summary=summary, params=params)
    t_start = time.perf_counter()
    t_wall = time.time()
    workdir = pathlib.Path(workdir) if workdir is not None else None
    if workdir is not None and corpus is None and task.dataset is None:
        dataset_lib.check_workdir_data(config, workdir)
    data = dataset_lib.load_dataset(config, corpus, task)
    val_batches = data.validation_batches(config.data.batch_size, config.eval.batches)
    checkpoint_dir = workdir / "checkpoints" if workdir and config.checkpoint.every else None
    trainer = build_trainer(config, data, devices, checkpoint_dir, supervised_controls or (), task)
    timeline = _timeline(config, workdir, fresh=not supervised, t_start=t_wall)
    _mark(timeline, "restoring")
    start_step = trainer.restore() if checkpoint_dir else 0
    end_step = min(config.train_steps, stop_after or config.train_steps)
    writer = None
    if workdir:
        own = make_writers(config, workdir, start_step)
        writer = MetricsWriter(workdir, start_step, writers=own + list(writers))
    progress = Progress(config.mode, config.train_steps, start_step)
    tokens_per_step = config.num_learners * task.tokens_per_step(config.data.batch_size)
    if start_step:
        print(f"[{config.mode}] resumed from checkpoint at step {start_step}", flush=True)

    def evaluate(params: Params, batches: Sequence[Any]) -> dict[str, float]:
        return trainer.islands[0].evaluate_metrics(params, batches, trainer.eval_local())

    # The global model changes only at syncs (every step in dp, every H in diloco): evaluate at
    # the first sync at or after each multiple of `eval.every`, decided from the step alone so
    # a resumed run evaluates where an uninterrupted one would; always at the last step.
    sync_period = config.inner_steps if config.mode == "diloco" else 1
    every = config.eval.every
    eval_metrics: dict[str, float] = {}
    losses = None
    t_log, step_log = time.perf_counter(), start_step
    ring = ring_allreduce_bytes(config.num_learners, count_params(trainer.global_params()))

    def traffic(step: int, syncs: int) -> int:
        """Bytes all learners sent: a ring all-reduce every step (dp) or outer step (diloco)."""
        return config.num_learners * ring * (step if config.mode == "dp" else syncs)

    try:
        for step in range(start_step + 1, end_step + 1):
            _mark(timeline, "compiling" if step == start_step + 1 else "stepping", step)
            losses, synced = trainer.step(step)
            if step == start_step + 1:  # the step that compiled: done only once it has run
                jax.block_until_ready(losses)
            is_last = step == end_step
            previous_sync = (step - 1) // sync_period * sync_period
            crossed = bool(every) and step // every > previous_sync // every
            event: dict[str, Any] = {}
            if is_last or (synced and crossed):
                jax.block_until_ready(losses)  # dispatched steps' compute is stepping time
                _mark(timeline, "evaluating")
                eval_metrics = evaluate(trainer.global_params(), val_batches)
                # eval_loss and every metric of the task (accuracy, MoE routing statistics).
                event.update({f"eval_{k}": v for k, v in eval_metrics.items()})
            if step % config.log_every == 0 or is_last or event:
                learner_losses = [float(x) for x in jax.device_get(losses)]
                now = time.perf_counter()
                tokens_per_s = (step - step_log) * tokens_per_step / max(now - t_log, 1e-9)
                t_log, step_log = now, step
                mean_loss = float(np.mean(learner_losses))
                progress.show(step, mean_loss, tokens_per_s, event.get("eval_loss"))
                if writer:
                    writer.write(
                        step=step,
                        tokens=step * tokens_per_step,
                        loss=mean_loss,
                        learner_losses=learner_losses,
                        wall_s=progress.elapsed(),
                        tokens_per_s=tokens_per_s,
                        outer_syncs=trainer.syncs,
                        # All learners so far; a ring all-reduce sends and receives as much.
                        bytes_sent=traffic(step, trainer.syncs),
                        bytes_received=traffic(step, trainer.syncs),
                        **event,
                    )
            if checkpoint_dir and (step % config.checkpoint.every == 0 or is_last):
                jax.block_until_ready(losses)
                _mark(timeline, "checkpointing")
                trainer.save(step)
    finally:  # Even on an error, let started asynchronous saves finish.
        for checkpointer in trainer.checkpointers:
            checkpointer.close()
    _mark(timeline, "done")
    if end_step == start_step:  # Nothing left to train: report the restored model.
        eval_metrics = evaluate(trainer.global_params(), val_batches)
    params = jax.device_get(trainer.global_params())
    resilience = {}
    if timeline is not None:  # goodput and uptime, as every mode reports them
        result = timeline_lib.analyze(timeline_lib.load(timeline.path.parent))
        resilience = dict(
            goodput=result.goodput, uptime=result.uptime, lost_steps=result.lost_steps
        )
        resilience.update(failures_injected=0, recoveries=0, max_staleness=0)
        timeline.close()
    summary = RunSummary(
        config=config,
        steps_done=end_step,
        tokens=end_step * tokens_per_step,
        wall_s=time.perf_counter() - t_start,
        train_wall_s=progress.elapsed(),
        eval_metrics=eval_metrics,
        task=task.identity(),
        token_unit=task.token_unit,
        data=dataset_lib.describe(data),
        final_train_loss=float(np.mean(jax.device_get(losses))) if losses else None,
        outer_syncs=trainer.syncs,
        params=count_params(params),
        bytes_sent=traffic(end_step, trainer.syncs),
        bytes_received=traffic(end_step, trainer.syncs),
        dp_equivalent_bytes=config.num_learners * ring * end_step,
        resilience=resilience,
        extra={"resumed_from_step": start_step},
    ).as_dict()
    if writer:
        writer.close()
        write_summary(workdir, summary)
    return RunResult(summary=summary, params=params)


def _timeline(
    config: config_lib.ExperimentConfig,
    workdir: pathlib.Path | None,
    fresh: bool,
    t_start: float,
) -> timeline_lib.Timeline | None:
    """The synchronous group's timeline (one file, every learner), or None without a workdir.

    A run that is not supervised records its own start; a supervised one's supervisor did.
    """
    if workdir is None:
        return None
    directory = workdir / "timeline"
    if fresh:
        for stale in directory.glob("*.jsonl") if directory.exists() else []:
            stale.unlink()
    timeline = timeline_lib.Timeline(directory, "trainer", range(config.num_learners))
    if fresh:
        timeline.enter("starting", t=t_start)
    return timeline


def _mark(timeline: timeline_lib.Timeline | None, state: str, step: int = -1) -> None:
    if timeline is not None:
        timeline.enter(state, step)


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
