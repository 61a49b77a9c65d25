"""decoupled_diloco: resilient, asynchronous, multi-island training in JAX.

The public surface, importable from Colab and research code:

    import decoupled_diloco as dd
    config = dd.ExperimentConfig(mode="diloco", num_learners=2, inner_steps=50)
    result = dd.train_and_evaluate(config, workdir="runs/mine")
"""

import importlib
from typing import Any

# Public name -> defining module. Imported lazily (PEP 562) so that numpy-only parts, such as
# the goodput simulator or a syncer's config loading, do not pay for importing JAX.
_EXPORTS = {
    "CheckpointConfig": "decoupled_diloco.config",
    "ConfigError": "decoupled_diloco.config",
    "Corpus": "decoupled_diloco.data",
    "DataConfig": "decoupled_diloco.config",
    "DataParallelTrainer": "decoupled_diloco.trainers",
    "DecoupledConfig": "decoupled_diloco.config",
    "Learner": "decoupled_diloco.learner",
    "SyncerClient": "decoupled_diloco.comm.client",
    "SyncerConfig": "decoupled_diloco.config",
    "SyncerServer": "decoupled_diloco.syncer",
    "SyncerState": "decoupled_diloco.syncer_state",
    "delayed_nesterov": "decoupled_diloco.outer",
    "run_decoupled": "decoupled_diloco.launch",
    "DiLoCoTrainer": "decoupled_diloco.trainers",
    "EvalConfig": "decoupled_diloco.config",
    "ExperimentConfig": "decoupled_diloco.config",
    "InnerState": "decoupled_diloco.island",
    "Island": "decoupled_diloco.island",
    "MeshConfig": "decoupled_diloco.config",
    "ModelConfig": "decoupled_diloco.config",
    "OptimConfig": "decoupled_diloco.config",
    "OuterConfig": "decoupled_diloco.config",
    "partition": "decoupled_diloco.fragments",
    "RunResult": "decoupled_diloco.train",
    "Transformer": "decoupled_diloco.model",
    "as_config_dict": "decoupled_diloco.config",
    "build_trainer": "decoupled_diloco.train",
    "from_config_dict": "decoupled_diloco.config",
    "lm_loss": "decoupled_diloco.model",
    "load_corpus": "decoupled_diloco.data",
    "make_island_mesh": "decoupled_diloco.island",
    "make_outer_optimizer": "decoupled_diloco.outer",
    "merge": "decoupled_diloco.outer",
    "outer_gradient": "decoupled_diloco.outer",
    "outer_step": "decoupled_diloco.outer",
    "radial_directional_average": "decoupled_diloco.outer",
    "train_and_evaluate": "decoupled_diloco.train",
    "train_iterator": "decoupled_diloco.data",
    "validate": "decoupled_diloco.config",
    "validation_batches": "decoupled_diloco.data",
    "weighted_mean": "decoupled_diloco.outer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
