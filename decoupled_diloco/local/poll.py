"""The launcher's watch over a running decoupled job, until every learner has finished.

It polls the syncer's status, shows one progress line for all learners, appends to
`metrics.jsonl`, and every `eval.every` steps evaluates the global parameters (the model the
syncer would hand out, as the synchronous modes evaluate theirs). A child that died on its own
ends the run through the supervisor's check.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.local.evaluator import GlobalEvaluator
from decoupled_diloco.obs import watch as watch_lib
from decoupled_diloco.obs.metrics import MetricsWriter


def progress_line(status: dict[str, Any], total_steps: int, elapsed: float) -> str:
    """One line for all learners: state, step, loss and fragment versions, plus merges.

    `total_steps` 0: a run on data leases, whose learners' step counts follow their speed; the
    line ends with the share of the budget the global model holds (the data ledger).
    """
    parts = []
    for i, info in status["learners"].items():
        loss = info["loss"]
        loss_text = f"{loss:.3f}" if loss == loss else "-"
        step = f"{info['step']}/{total_steps}" if total_steps else str(info["step"])
        parts.append(f"L{i} {info['state'][:5]} {step} loss {loss_text} v{info['versions']}")
    line = f"[decoupled] {elapsed:5.0f}s | " + " | ".join(parts) + f" | merges {status['merges']}"
    ledger = status.get("data_ledger")
    if ledger and ledger.get("windows"):
        line += f" | data {ledger['consumed_once'] / ledger['windows']:.0%}"
    return line


def watch(
    config: config_lib.ExperimentConfig,
    supervisor: Any,
    client: SyncerClient,
    evaluate: GlobalEvaluator,
    workdir: pathlib.Path,
    t_start: float,
    progress_s: float,
    writers: Sequence[Any] = (),
) -> dict[str, Any]:
    """Polls the syncer until every learner has finished; writes metrics and progress.

    `supervisor` (`supervisor.Supervisor`) owns the children: it restarts those a fault killed,
    and reports any that died on their own.

    Every `eval.every` steps (mean over learners) it also evaluates the global parameters, the
    model the syncer would hand out, as the synchronous modes evaluate theirs. Every event also
    goes to `writers` (`obs.writers`), which are closed at the end.
    """
    next_eval = config.eval.every
    writer = MetricsWriter(workdir, writers=writers)
    status: dict[str, Any] = {"merges": 0, "learners": {}}
    staleness = 0  # the largest version lag of a learner seen (summary: max_staleness)
    progress = watch_lib.RunProgress("decoupled")
    try:
        while True:
            supervisor.check()  # a child that died on its own, not by a fault, ends the run
            done = supervisor.finished(supervisor.learner_names())  # (joins included)
            try:
                status = client.status()
            except Exception as error:  # noqa: BLE001 - report and keep watching the children.
                print(f"[decoupled] status failed: {error}", flush=True)
            elapsed = time.perf_counter() - t_start
            learners = status["learners"]
            if learners:
                steps = [x["step"] for x in learners.values()]
                event: dict[str, Any] = {}
                staleness = max([staleness] + [x.get("staleness", 0) for x in learners.values()])
                if config.eval.every and np.mean(steps) >= next_eval:
                    try:
                        evaluate()
                        event.update(evaluate.event())  # eval_loss (+ eval_accuracy, ...)
                    except Exception as error:  # noqa: BLE001 - e.g. a syncer killed by a fault.
                        print(f"[decoupled] evaluation skipped: {error}", flush=True)
                    while next_eval <= np.mean(steps):
                        next_eval += config.eval.every
                # NaN (no step yet) becomes null: every line stays valid JSON.
                losses = [x["loss"] if x["loss"] == x["loss"] else None for x in learners.values()]
                evals = [
                    x["eval_loss"] for x in learners.values() if x["eval_loss"] == x["eval_loss"]
                ]
                total = 0 if config_lib.data_leases(config) else config.train_steps
                progress.show(status, progress_line(status, total, elapsed), elapsed)
                writer.write(
                    step=int(np.mean(steps)),
                    tokens=sum(x["tokens"] for x in learners.values()),
                    loss=float(np.mean([v for v in losses if v is not None]))
                    if any(v is not None for v in losses)
                    else None,
                    learner_ids=[int(i) for i in learners],
                    learner_losses=losses,
                    learner_steps=steps,
                    learner_states=[x["state"] for x in learners.values()],
                    versions=[f["version"] for f in status["fragments"]],
                    wall_s=elapsed,
                    outer_syncs=status["merges"],
                    # Per learner, cumulative: bytes pushed and pulled, push rounds done.
                    learner_bytes_sent=[x.get("bytes_sent", 0) for x in learners.values()],
                    learner_bytes_received=[x.get("bytes_received", 0) for x in learners.values()],
                    learner_sync_rounds=[x.get("sync_rounds", 0) for x in learners.values()],
                    **({"learner_eval_loss": float(np.mean(evals))} if evals else {}),
                    **event,
                )
            if done:
                return {**wait_for_last_merges(client, status), "max_staleness": staleness}
            time.sleep(progress_s)
    finally:
        progress.close()
        writer.close()


def wait_for_last_merges(client: SyncerClient, status: dict[str, Any]) -> dict[str, Any]:
    """After the learners exit, their final pushes close within the syncer's next tick."""
    deadline = time.monotonic() + 30
    while any(f["pending"] for f in status["fragments"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        status = client.status()
    return status
