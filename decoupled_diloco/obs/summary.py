"""The run summary every mode writes as `summary.json` and returns as `RunResult.summary`.

One definition of the numbers a run reports, so that every mode reports them under the same
names (docs/concepts.md, "Outputs of a run"); a mode adds its own beside them (`extra`: the
decoupled mode's learners, merges, data ledger and membership; a resumed run's start step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decoupled_diloco.config import ExperimentConfig


@dataclasses.dataclass
class RunSummary:
    """What a finished run reports.

    Attributes:
      config: the experiment, written in full.
      steps_done: inner steps each learner trained (decoupled: the budget's, see the ledger).
      tokens: training tokens over all learners (in `token_unit`s).
      wall_s: seconds from the start of the run to its summary.
      train_wall_s: seconds of the training loop (decoupled: the slowest learner's).
      eval_metrics: the final global model's held-out metrics ("loss", and the task's others).
      task: the task's identity (`Task.identity`).
      token_unit: what `tokens` counts ("byte", "token", "example", ...).
      data: (summary key, facts) of the data trained on (`dataset.describe`).
      final_train_loss: the mean of the learners' last training losses (None: no step).
      outer_syncs: outer steps (dp: every step; decoupled: the syncer's merges).
      params: parameters of the model.
      bytes_sent: what all learners sent (decoupled: pushes and pulls, headers included).
      bytes_received: what all learners received.
      dp_equivalent_bytes: what a ring all-reduce of float32 gradients every step would move.
      resilience: goodput, uptime, lost steps, faults and recoveries (`obs.timeline`); empty
        for a run without a workdir (no timeline).
      extra: the mode's own fields.
    """

    config: ExperimentConfig
    steps_done: int
    tokens: int
    wall_s: float
    train_wall_s: float
    eval_metrics: dict[str, float]
    task: dict[str, Any]
    token_unit: str
    data: tuple[str, dict[str, Any]]
    final_train_loss: float | None
    outer_syncs: int
    params: int
    bytes_sent: int
    bytes_received: int
    dp_equivalent_bytes: int
    resilience: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The summary as `summary.json` holds it: final metrics as `final_eval_NAME`."""
        c = self.config
        data_key, data_facts = self.data
        return {
            "mode": c.mode,
            "num_learners": c.num_learners,
            "inner_steps": c.inner_steps,
            "train_steps": c.train_steps,
            "steps_done": self.steps_done,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "train_wall_s": self.train_wall_s,
            "final_eval_loss": self.eval_metrics.get("loss"),
            **{f"final_eval_{k}": v for k, v in self.eval_metrics.items() if k != "loss"},
            "task": self.task,
            "token_unit": self.token_unit,
            data_key: data_facts,
            "final_train_loss": self.final_train_loss,
            "outer_syncs": self.outer_syncs,
            "params": self.params,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dp_equivalent_bytes": self.dp_equivalent_bytes,
            **self.resilience,
            **self.extra,
            "config": dataclasses.asdict(c),
        }
