"""A `dp` or `diloco` run in this process: the step loop, evaluation, metrics, checkpoints.

`InProcessRun(...).run()` is what `train_and_evaluate` does for the synchronous modes (and, under
faults, in the child process a supervisor runs: `local.synchronous`). It builds one data shard
and island per learner (`build_trainer`), resumes from the newest readable checkpoint, and per
step: trains, evaluates the global model where due, logs, checkpoints; at the end it writes the
summary (`obs.summary`).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from decoupled_diloco import config as config_lib
from decoupled_diloco import tasks
from decoupled_diloco.core.compression import ring_allreduce_bytes
from decoupled_diloco.data import dataset as dataset_lib
from decoupled_diloco.data.heldout import evaluate_sets, held_out_sets
from decoupled_diloco.models.transformer import count_params
from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.obs.metrics import MetricsWriter, Progress, make_writers, write_summary
from decoupled_diloco.obs.summary import RunSummary
from decoupled_diloco.obs.writers import MetricWriter
from decoupled_diloco.trainers import DataParallelTrainer, DiLoCoTrainer

TRAINERS = {"dp": DataParallelTrainer, "diloco": DiLoCoTrainer}
Params = Any


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


class InProcessRun:
    """One synchronous run, set up here and trained by `run`.

    Args:
      config: the experiment (validated, paths absolute).
      workdir: where metrics, summary, timeline and checkpoints go; None: nowhere.
      devices: every learner's devices.
      task: what is trained.
      corpus: pre-loaded data (default: the task's, else `config.data`'s).
      stop_after: stop (with a checkpoint) after this global step, as a preemption would.
      controls: set in the child process a fault supervisor runs: each learner's live fault
        controls (its supervisor recorded the run's start, so the timeline is not restarted).
      writers: the user's own metric writers, beside those `config.metrics` names.
    """

    def __init__(
        self,
        config: config_lib.ExperimentConfig,
        workdir: pathlib.Path | None,
        devices: Sequence[jax.Device],
        task: tasks.Task,
        corpus: Any = None,
        stop_after: int | None = None,
        controls: Sequence[Any] | None = None,
        writers: Sequence[MetricWriter] = (),
    ):
        self.t_start, t_wall = time.perf_counter(), time.time()
        self.config, self.workdir, self.task = config, workdir, task
        if workdir is not None and corpus is None and task.dataset is None:
            dataset_lib.check_workdir_data(config, workdir)
        self.data = dataset_lib.load_dataset(config, corpus, task)
        self.sets = held_out_sets(config, self.data)
        self.checkpoint_dir = (
            workdir / "checkpoints" if workdir and config.checkpoint.every else None
        )
        self.trainer = build_trainer(
            config, self.data, devices, self.checkpoint_dir, controls or (), task
        )
        self.timeline = _timeline(config, workdir, fresh=controls is None, t_start=t_wall)
        self._mark("restoring")
        self.start_step = self.trainer.restore() if self.checkpoint_dir else 0
        self.end_step = min(config.train_steps, stop_after or config.train_steps)
        self.writer = None
        if workdir is not None:
            own = make_writers(config, workdir, self.start_step)
            self.writer = MetricsWriter(workdir, self.start_step, writers=own + list(writers))
        self.progress = Progress(config.mode, config.train_steps, self.start_step)
        self.tokens_per_step = config.num_learners * task.tokens_per_step(config.data.batch_size)
        self.ring = ring_allreduce_bytes(
            config.num_learners, count_params(self.trainer.global_params())
        )
        self.eval_metrics: dict[str, float] = {}
        self.losses: Any = None
        self.t_log, self.step_log = time.perf_counter(), self.start_step
        if self.start_step:
            print(f"[{config.mode}] resumed from checkpoint at step {self.start_step}", flush=True)

    def run(self) -> tuple[dict[str, Any], Params]:
        """Trains to the end (or `stop_after`); returns the summary and the global parameters."""
        try:
            for step in range(self.start_step + 1, self.end_step + 1):
                self._step(step)
        finally:  # Even on an error, let started asynchronous saves finish.
            for checkpointer in self.trainer.checkpointers:
                checkpointer.close()
        self._mark("done")
        if self.end_step == self.start_step:  # Nothing left to train: report the restored model.
            self.eval_metrics = self._evaluate()
        return self._finish()

    def _step(self, step: int) -> None:
        """One global step: train, evaluate if due, log, checkpoint."""
        first, is_last = step == self.start_step + 1, step == self.end_step
        self._mark("compiling" if first else "stepping", step)
        self.losses, synced = self.trainer.step(step)
        if first:  # the step that compiled: done only once it has run
            jax.block_until_ready(self.losses)
        event: dict[str, Any] = {}
        if is_last or (synced and self._eval_due(step)):
            jax.block_until_ready(self.losses)  # dispatched steps' compute is stepping time
            self._mark("evaluating")
            self.eval_metrics = self._evaluate()
            # eval_loss and every metric of the task (accuracy, MoE routing statistics).
            event.update({f"eval_{k}": v for k, v in self.eval_metrics.items()})
        if step % self.config.log_every == 0 or is_last or event:
            self._log(step, event)
        every = self.config.checkpoint.every
        if self.checkpoint_dir and (step % every == 0 or is_last):
            jax.block_until_ready(self.losses)
            self._mark("checkpointing")
            self.trainer.save(step)

    def _eval_due(self, step: int) -> bool:
        """Whether a sync at `step` is the first at or after a multiple of `eval.every`.

        The global model changes only at syncs (every step in dp, every H in diloco); decided
        from the step alone, so a resumed run evaluates where an uninterrupted one would.
        """
        every = self.config.eval.every
        period = self.config.inner_steps if self.config.mode == "diloco" else 1
        previous_sync = (step - 1) // period * period
        return bool(every) and step // every > previous_sync // every

    def _evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        params, local = trainer.global_params(), trainer.eval_local()
        island = trainer.islands[0]
        # Every held-out set (the run's and `eval.sets`), with bits per byte (`data.heldout`).
        return evaluate_sets(self.sets, lambda b: island.evaluate_metrics(params, b, local))

    def _traffic(self, step: int) -> int:
        """Bytes all learners sent: a ring all-reduce every step (dp) or outer step (diloco)."""
        syncs = self.trainer.syncs
        return self.config.num_learners * self.ring * (step if self.config.mode == "dp" else syncs)

    def _log(self, step: int, event: dict[str, Any]) -> None:
        """A progress line and a metrics event."""
        learner_losses = [float(x) for x in jax.device_get(self.losses)]
        now = time.perf_counter()
        tokens_per_s = (step - self.step_log) * self.tokens_per_step / max(now - self.t_log, 1e-9)
        self.t_log, self.step_log = now, step
        mean_loss = float(np.mean(learner_losses))
        self.progress.show(step, mean_loss, tokens_per_s, event.get("eval_loss"))
        if self.writer:
            self.writer.write(
                step=step,
                tokens=step * self.tokens_per_step,
                loss=mean_loss,
                learner_losses=learner_losses,
                wall_s=self.progress.elapsed(),
                tokens_per_s=tokens_per_s,
                outer_syncs=self.trainer.syncs,
                # All learners so far; a ring all-reduce sends and receives as much.
                bytes_sent=self._traffic(step),
                bytes_received=self._traffic(step),
                **event,
            )

    def _finish(self) -> tuple[dict[str, Any], Params]:
        """The summary (written to the workdir) and the global parameters on the host."""
        config, end = self.config, self.end_step
        params = jax.device_get(self.trainer.global_params())
        resilience: dict[str, Any] = {}
        if self.timeline is not None:  # goodput and uptime, as every mode reports them
            result = timeline_lib.analyze(timeline_lib.load(self.timeline.path.parent))
            resilience = dict(
                goodput=result.goodput, uptime=result.uptime, lost_steps=result.lost_steps
            )
            resilience.update(failures_injected=0, recoveries=0, max_staleness=0)
            self.timeline.close()
        losses = self.losses
        summary = RunSummary(
            config=config,
            steps_done=end,
            tokens=end * self.tokens_per_step,
            wall_s=time.perf_counter() - self.t_start,
            train_wall_s=self.progress.elapsed(),
            eval_metrics=self.eval_metrics,
            task=self.task.identity(),
            token_unit=self.task.token_unit,
            data=dataset_lib.describe(self.data),
            final_train_loss=float(np.mean(jax.device_get(losses))) if losses else None,
            outer_syncs=self.trainer.syncs,
            params=count_params(params),
            bytes_sent=self._traffic(end),
            bytes_received=self._traffic(end),
            dp_equivalent_bytes=config.num_learners * self.ring * end,
            resilience=resilience,
            extra={"resumed_from_step": self.start_step},
        ).as_dict()
        if self.writer:
            self.writer.close()
            write_summary(self.workdir, summary)
        return summary, params

    def _mark(self, state: str, step: int = -1) -> None:
        if self.timeline is not None:
            self.timeline.enter(state, step)


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
