"""The summary of a decoupled job: the learners' summaries, the syncer's last status, the eval.

Built once at the end of `local.launch.run_decoupled` as a `RunSummary`, the same record every
mode writes (`summary.json`), with the decoupled mode's own facts beside it: merge sizes, the
data ledger, membership changes, each learner's summary and what each emulated WAN link carried.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import jax
import numpy as np

from decoupled_diloco import config as config_lib
from decoupled_diloco.core.compression import ring_allreduce_bytes
from decoupled_diloco.local import chaos_run
from decoupled_diloco.local import supervisor as supervisor_lib
from decoupled_diloco.local.evaluator import GlobalEvaluator
from decoupled_diloco.obs.summary import RunSummary


def steps_done(config: config_lib.ExperimentConfig, learners: list, ledger: dict | None) -> int:
    """Steps per learner that the global model holds.

    On data leases, the budget's batches that every fragment holds once, over `num_learners`
    (learners train unequal shares); on static shards, the fewest any learner trained.
    """
    if ledger is None:
        return min(x["steps"] for x in learners)
    return ledger["consumed_once"] // config.data.batch_size // config.num_learners


def learner_summaries(
    supervisor: supervisor_lib.Supervisor, workdir: pathlib.Path
) -> list[dict[str, Any]]:
    """The summaries of every learner that trained, the starting ones and those that joined.

    (One asked to leave before it could write its summary has none.)
    """
    left = {i for c in supervisor.children.values() if c.left for i in c.learners}
    paths = {i: workdir / f"learner_{i}.json" for i in supervisor.learner_ids()}
    return [json.loads(p.read_text()) for i, p in paths.items() if i not in left or p.exists()]


def print_ledger(ledger: dict[str, Any]) -> None:
    """The data ledger's line: every window of the budget consumed once, or what is not."""
    print(
        f"[decoupled] data ledger: {ledger['consumed_once']} of {ledger['windows']} windows "
        f"consumed once, {ledger['missing']} missing ({ledger['missing_pending']} in rounds "
        f"still open), {ledger['repeated']} repeated; leases handed again "
        f"{ledger['leases_handed_again']}",
        flush=True,
    )


def job_summary(
    config: config_lib.ExperimentConfig,
    task: Any,
    learners: list[dict[str, Any]],
    status: dict[str, Any],
    evaluator: GlobalEvaluator,
    eval_loss: float,
    params: Any,
    workdir: pathlib.Path,
    events: supervisor_lib.EventLog,
    links: dict[str, Any],
    t_start: float,
) -> dict[str, Any]:
    """The job's summary: the learners' summaries, the syncer's last status, the evaluation."""
    num_params = int(sum(x.size for x in jax.tree.leaves(params)))
    return RunSummary(
        config=config,
        steps_done=steps_done(config, learners, status.get("data_ledger")),
        tokens=sum(x["tokens"] for x in learners),
        wall_s=time.perf_counter() - t_start,
        train_wall_s=max(x["train_wall_s"] for x in learners),
        eval_metrics={"loss": eval_loss, **evaluator.metrics},
        task=task.identity(),
        token_unit=task.token_unit,
        data=(evaluator.data_key, evaluator.data_facts),
        final_train_loss=float(np.mean([x["final_loss"] for x in learners])),
        outer_syncs=status["merges"],
        params=num_params,
        # Traffic of all learners' pushes and pulls (headers included), next to what a ring
        # all-reduce of float32 gradients every step would have moved for the same steps.
        bytes_sent=sum(x.get("bytes_sent", 0) for x in learners),
        bytes_received=sum(x.get("bytes_received", 0) for x in learners),
        dp_equivalent_bytes=sum(x["steps"] for x in learners)
        * ring_allreduce_bytes(config.num_learners, num_params),
        # Goodput, uptime, faults and recoveries (see `timeline` for the definitions).
        resilience={
            **chaos_run.chaos_summary(workdir, events, t_end=time.time()),
            "max_staleness": status.get("max_staleness", 0),
        },
        extra={
            "merge_sizes": status["merge_sizes"],
            "fragments": status["fragments"],
            "merge_log": status.get("merge_log", []),  # the syncer's last 200 merges
            # Data leases (`syncer.ledger`): every window of the budget in the model once?
            "data_ledger": status.get("data_ledger"),
            "membership": status.get("membership", []),  # joins, restarts, leaves, losses
            "stall_fraction_max": max(x["stall_fraction"] for x in learners),
            "learners": learners,
            **({"wan": links} if links else {}),  # `decoupled.wan_mbit`: what each link carried
        },
    ).as_dict()
