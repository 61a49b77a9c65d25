"""Values derived from a config: τ, and each learner's mesh shape."""

from __future__ import annotations

import math

from decoupled_diloco.config.schema import ConfigError, ExperimentConfig


def overlap_steps(config: ExperimentConfig) -> int:
    """τ: `decoupled.overlap_steps`, or H // 5 where it is -1 (the default)."""
    tau = config.decoupled.overlap_steps
    return config.inner_steps // 5 if tau < 0 else tau


def parse_mesh_shapes(config: ExperimentConfig) -> list[tuple[int, int]]:
    """Each learner's (`data`, `model`) mesh shape: `decoupled.mesh_shapes`, else `mesh.shape`.

    Raises:
      ConfigError: a malformed list or one whose length is not `num_learners`.
    """
    text = config.decoupled.mesh_shapes.strip()
    if not text:
        return [tuple(config.mesh.shape)] * config.num_learners
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ConfigError(
                f"config.decoupled.mesh_shapes: {item!r} is not DATAxMODEL (e.g. 2x1)"
            )
        shapes.append((int(parts[0]), int(parts[1])))
    if len(shapes) != config.num_learners:
        raise ConfigError(
            f"config.decoupled.mesh_shapes: {len(shapes)} shapes for {config.num_learners} learners"
        )
    return shapes


def mesh_shape_for(config: ExperimentConfig, learner_id: int, override: str) -> tuple[int, int]:
    """This learner's mesh: the `--mesh_shape` flag, else the config."""
    if override:
        parts = override.lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
            raise ValueError(f"--mesh_shape: {override!r} is not DATAxMODEL (e.g. 2x1)")
        return int(parts[0]), int(parts[1])
    shapes = parse_mesh_shapes(config)
    # A learner that joined beyond the starting ones takes the default mesh.
    return shapes[learner_id] if learner_id < len(shapes) else tuple(config.mesh.shape)


def max_learners(config: ExperimentConfig) -> int:
    """How many learner ids may register: `decoupled.max_learners`, else twice `num_learners`."""
    return config.decoupled.max_learners or 2 * config.num_learners


def lease_shards(config: ExperimentConfig) -> int:
    """S: `decoupled.data_shards`, fewer where a lease would be shorter than one round.

    A lease holds at least `inner_steps` batches, so that a learner holding its next lease
    trains on through a syncer outage of two rounds (`learner.leases`).
    """
    budget = config.num_learners * config.train_steps
    return max(1, min(config.decoupled.data_shards, budget // max(config.inner_steps, 1)))


def lease_unit(config: ExperimentConfig) -> int:
    """Rows of one unit of the data ledger: a batch, or `decoupled.lease_unit` ("constant").

    Raises:
      ConfigError: the unit does not divide `data.batch_size`, or some learner's data-parallel
        size does not divide it (its steps could not be split over its devices).
    """
    d, rows = config.decoupled, config.data.batch_size
    if d.global_batch != "constant":
        return rows
    sizes = [data for data, _ in parse_mesh_shapes(config)] + [config.mesh.shape[0]]
    unit = d.lease_unit or math.lcm(*sizes)
    if rows % unit or any(unit % s for s in sizes):
        raise ConfigError(
            f"config.decoupled.lease_unit: a unit of {unit} rows must divide data.batch_size="
            f"{rows} and be a multiple of every learner's data-parallel size {sorted(set(sizes))}"
        )
    return unit


def budget_units(config: ExperimentConfig) -> int:
    """The run's budget in ledger units: `num_learners` · `train_steps` batches."""
    return config.num_learners * config.train_steps * config.data.batch_size // lease_unit(config)


def units_per_step(config: ExperimentConfig, live: int) -> int:
    """Ledger units one leased step trains with `live` learners training.

    "per_learner": one (a batch). "constant": the global batch (`num_learners` batches) over
    the live learners, rounded to whole units, at least one.
    """
    unit = lease_unit(config)
    per_batch = config.data.batch_size // unit
    if config.decoupled.global_batch != "constant":
        return per_batch
    return max(1, round(per_batch * config.num_learners / max(live, 1)))


def data_leases(config: ExperimentConfig) -> bool:
    """Whether learners train on data leases from the syncer's ledger (`decoupled.data_shards`)."""
    return config.decoupled.data_shards > 0 and config.decoupled.syncer.shards == 1


def max_push_steps(config: ExperimentConfig, names_data: bool = True) -> int:
    """Inner steps one push (a learner's pending pushes of a fragment together) may hold.

    `train_steps`; on data leases, for a push that names its batches (`names_data`), the whole
    budget's steps, `budget_units` (a step trains at least one unit): a learner may train
    other learners' leases, and a fragment held while its round trip is under way (a slow
    link) goes with every step since its last push.
    """
    return budget_units(config) if names_data and data_leases(config) else config.train_steps


def metric_writers(config: ExperimentConfig) -> list[str]:
    """`metrics.writers` ("tensorboard,wandb") as a list of names (checked by `validate`)."""
    return [n.strip() for n in config.metrics.writers.split(",") if n.strip()]
