r"""`make demo`: the tiny LM as 4 decoupled learners and a syncer, under a seeded chaos schedule.

  python -m experiments.train --config=experiments/configs/demo.py --workdir=runs/demo

Two learners are killed with kill -9 and restarted from their checkpoints while the others keep
training, and one runs 2x slower for a while (`experiments/chaos/demo.yaml`). The run ends with
`runs/demo/report.md`: eval loss, the learners' timeline with the faults marked, goodput and
uptime, and the bytes sent against data-parallel training.
"""

import dataclasses

from decoupled_diloco import config as c
from experiments.configs import tiny_lm_decoupled


def get_config():
    # A short overlap and merges of whatever has arrived (no waiting for a gathered round): with
    # learners killed and slowed, rounds rarely gather anyway. The settings of
    # benchmarks/results/demo.md.
    base = c.replace(
        c.from_config_dict(tiny_lm_decoupled.get_config()),
        **{
            "decoupled.overlap_steps": 2,
            "decoupled.keep_overlap": False,
            "decoupled.grace_safety": 0.5,
            "decoupled.syncer.max_grace_s": 2.0,
            "decoupled.partial_merge": "mean",
            "decoupled.apply_on_arrival": False,
        },
    )
    return c.as_config_dict(
        dataclasses.replace(
            base,
            num_learners=4,
            train_steps=450,
            # Quorum 1: each merge holds about one learner, so a step of 1/M sums to about a
            # plain average over a round of all four.
            outer=dataclasses.replace(base.outer, lr=0.25),
            checkpoint=dataclasses.replace(base.checkpoint, every=20),
            compression=dataclasses.replace(base.compression, scheme="e3m0"),
            eval=dataclasses.replace(base.eval, every=100),
            chaos="experiments/chaos/demo.yaml",
            # The live job page and every process's Prometheus metrics (docs/operations.md):
            # the URL is printed at the start; the page stays up until the report is written.
            monitor=dataclasses.replace(base.monitor, enabled=True),
        )
    )
