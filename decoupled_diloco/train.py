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

from decoupled_diloco import config as config_lib
from decoupled_diloco import data as data_lib
from decoupled_diloco.metrics import MetricsWriter, Progress, write_summary
from decoupled_diloco.model import Params, count_params
from decoupled_diloco.trainers import DataParallelTrainer, DiLoCoTrainer

TRAINERS = {"dp": DataParallelTrainer, "diloco": DiLoCoTrainer}


@dataclasses.dataclass
class RunResult:
    """What a run returns to its caller (the same numbers are in `summary.json`)."""

    summary: dict[str, Any]
    params: Params


def build_trainer(
    config: config_lib.ExperimentConfig,
    corpus: data_lib.Corpus,
    devices: Sequence[jax.Device],
    checkpoint_dir: pathlib.Path | None = None,
) -> DataParallelTrainer | DiLoCoTrainer:
    """The trainer for `config.mode`, with one data shard per learner."""
    iterators = [
        data_lib.train_iterator(
            corpus.train_BN,
            config.model.seq_len,
            config.data.batch_size,
            learner_id,
            config.num_learners,
            config.seed,
        )
        for learner_id in range(config.num_learners)
    ]
    return TRAINERS[config.mode](config, devices, iterators, checkpoint_dir)


def train_and_evaluate(
    config: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path | None,
    devices: Sequence[jax.Device] | None = None,
    stop_after: int | None = None,
    corpus: data_lib.Corpus | None = None,
) -> RunResult:
    """Trains `config` in `workdir`, resuming from its newest readable checkpoint.

    Args:
      config: the experiment; validated (including the device count) before anything compiles.
      workdir: where metrics, summary and checkpoints go; None keeps everything in memory.
      devices: devices to use (default: all); learner i gets the i-th slice.
      stop_after: stop (with a checkpoint) after this global step, as a preemption would.
      corpus: a pre-loaded corpus (default: load `config.data`).

    Returns:
      The summary and the final global parameters (host arrays).
    """
    if config.mode == "decoupled":  # Separate processes: a syncer and one per learner.
        from decoupled_diloco.launch import run_decoupled

        config_lib.validate(config)
        summary, params = run_decoupled(config, workdir, corpus=corpus)
        return RunResult(summary=summary, params=params)
    devices = list(devices if devices is not None else jax.devices())
    config_lib.validate(config, device_count=len(devices))
    t_start = time.perf_counter()
    corpus = corpus or data_lib.load_corpus(config.data.path, config.data.val_fraction)
    val_batches = data_lib.validation_batches(
        corpus.val_BN, config.model.seq_len, config.data.batch_size, config.eval.batches
    )
    workdir = pathlib.Path(workdir) if workdir is not None else None
    checkpoint_dir = workdir / "checkpoints" if workdir and config.checkpoint.every else None
    trainer = build_trainer(config, corpus, devices, checkpoint_dir)
    start_step = trainer.restore() if checkpoint_dir else 0
    end_step = min(config.train_steps, stop_after or config.train_steps)
    writer = MetricsWriter(workdir, resume_step=start_step) if workdir else None
    progress = Progress(config.mode, config.train_steps, start_step)
    tokens_per_step = config.num_learners * config.tokens_per_step
    if start_step:
        print(f"[{config.mode}] resumed from checkpoint at step {start_step}", flush=True)
    evaluate = trainer.islands[0].evaluate
    # The global model changes only at syncs (every step in dp, every H in diloco): evaluate at
    # the first sync at or after each multiple of `eval.every`, decided from the step alone so
    # a resumed run evaluates where an uninterrupted one would; always at the last step.
    sync_period = config.inner_steps if config.mode == "diloco" else 1
    every = config.eval.every
    eval_loss, losses = None, None
    t_log, step_log = time.perf_counter(), start_step
    try:
        for step in range(start_step + 1, end_step + 1):
            losses, synced = trainer.step(step)
            is_last = step == end_step
            previous_sync = (step - 1) // sync_period * sync_period
            crossed = bool(every) and step // every > previous_sync // every
            event: dict[str, Any] = {}
            if is_last or (synced and crossed):
                eval_loss = evaluate(trainer.global_params(), val_batches)
                event["eval_loss"] = eval_loss
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
                        **event,
                    )
            if checkpoint_dir and (step % config.checkpoint.every == 0 or is_last):
                trainer.save(step)
    finally:  # Even on an error, let started asynchronous saves finish.
        for checkpointer in trainer.checkpointers:
            checkpointer.close()
    if end_step == start_step:  # Nothing left to train: report the restored model.
        eval_loss = evaluate(trainer.global_params(), val_batches)
    params = jax.device_get(trainer.global_params())
    summary = {
        "mode": config.mode,
        "num_learners": config.num_learners,
        "inner_steps": config.inner_steps,
        "train_steps": config.train_steps,
        "steps_done": end_step,
        "resumed_from_step": start_step,
        "tokens": end_step * tokens_per_step,
        "wall_s": time.perf_counter() - t_start,
        "train_wall_s": progress.elapsed(),
        "final_eval_loss": eval_loss,
        "final_train_loss": float(np.mean(jax.device_get(losses))) if losses else None,
        "outer_syncs": trainer.syncs,
        "params": count_params(params),
        "corpus": {
            "root": corpus.root,
            "files": corpus.num_files,
            "train_tokens": len(corpus.train_BN),
            "val_tokens": len(corpus.val_BN),
        },
        "config": dataclasses.asdict(config),
    }
    if writer:
        writer.close()
        write_summary(workdir, summary)
    return RunResult(summary=summary, params=params)
