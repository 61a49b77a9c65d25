"""Values derived from a config: τ, and each learner's mesh shape."""

from __future__ import annotations

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


def data_leases(config: ExperimentConfig) -> bool:
    """Whether learners train on data leases from the syncer's ledger (`decoupled.data_shards`)."""
    return config.decoupled.data_shards > 0 and config.decoupled.syncer.shards == 1
