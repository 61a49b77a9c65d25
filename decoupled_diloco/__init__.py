"""decoupled_diloco: resilient, asynchronous, multi-island training in JAX.

The public surface, importable from Colab and research code:

    import decoupled_diloco as dd
    config = dd.ExperimentConfig(mode="diloco", num_learners=2, inner_steps=50)
    result = dd.train_and_evaluate(config, workdir="runs/mine")
"""

import importlib
from typing import Any

# Public name -> defining module, or (module, its name there). Imported lazily (PEP 562) so that
# numpy-only parts, such as the goodput simulator or a syncer's config loading, do not pay for
# importing JAX.
_EXPORTS = {
    "CheckpointConfig": "decoupled_diloco.config",
    "ConfigError": "decoupled_diloco.config",
    "Corpus": "decoupled_diloco.data.text",
    "DataConfig": "decoupled_diloco.config",
    "DataParallelTrainer": "decoupled_diloco.trainers",
    "DecoupledConfig": "decoupled_diloco.config",
    "Learner": "decoupled_diloco.learner.loop",
    "SyncerClient": "decoupled_diloco.comm.client",
    "SyncerConfig": "decoupled_diloco.config",
    "SyncerServer": "decoupled_diloco.syncer.server",
    "SyncerState": "decoupled_diloco.syncer.state",
    "delayed_nesterov": "decoupled_diloco.core.outer",
    "run_decoupled": "decoupled_diloco.local.launch",
    "DiLoCoTrainer": "decoupled_diloco.trainers",
    "EvalConfig": "decoupled_diloco.config",
    "ExperimentConfig": "decoupled_diloco.config",
    "InnerState": "decoupled_diloco.island",
    "Island": "decoupled_diloco.island",
    "MeshConfig": "decoupled_diloco.config",
    "ModelConfig": "decoupled_diloco.config",
    "OptimConfig": "decoupled_diloco.config",
    "OuterConfig": "decoupled_diloco.config",
    "partition": "decoupled_diloco.core.fragments",
    "RunResult": "decoupled_diloco.train",
    "Transformer": "decoupled_diloco.models.transformer",
    "as_config_dict": "decoupled_diloco.config",
    "build_trainer": "decoupled_diloco.train",
    "from_config_dict": "decoupled_diloco.config",
    "lm_loss": "decoupled_diloco.models.transformer",
    "load_corpus": "decoupled_diloco.data.text",
    "make_island_mesh": "decoupled_diloco.models.mesh",
    "make_outer_optimizer": "decoupled_diloco.core.outer",
    "merge": "decoupled_diloco.core.outer",
    "outer_gradient": "decoupled_diloco.core.outer",
    "outer_step": "decoupled_diloco.core.outer",
    "radial_directional_average": "decoupled_diloco.core.outer",
    "train_and_evaluate": "decoupled_diloco.train",
    "train_iterator": "decoupled_diloco.data.text",
    "validate": "decoupled_diloco.config",
    "validation_batches": "decoupled_diloco.data.text",
    "weighted_mean": "decoupled_diloco.core.outer",
    # Models and tasks beyond the dense LM (issue 8).
    "MoEConfig": "decoupled_diloco.config",
    "MoETransformer": "decoupled_diloco.models.moe",
    "ViT": "decoupled_diloco.models.vit",
    "Task": "decoupled_diloco.tasks",
    "make_task": "decoupled_diloco.tasks",
    "load_dataset": "decoupled_diloco.tasks",
    "load_images": "decoupled_diloco.data.vision",
    # Compression, chaos, goodput, reports, the simulator (issue 7's public surface).
    "CompressionConfig": "decoupled_diloco.config",
    "Codec": "decoupled_diloco.core.compression",
    "codec_for": "decoupled_diloco.core.compression",
    "ring_allreduce_bytes": "decoupled_diloco.core.compression",
    "ChaosSchedule": ("decoupled_diloco.chaos.faults", "Schedule"),
    "Fault": "decoupled_diloco.chaos.faults",
    "FailureModel": "decoupled_diloco.chaos.faults",
    "load_chaos": ("decoupled_diloco.chaos.faults", "load"),
    "Timeline": "decoupled_diloco.obs.timeline",
    "Goodput": "decoupled_diloco.obs.timeline",
    "analyze_goodput": ("decoupled_diloco.obs.timeline", "analyze"),
    "load_timeline": ("decoupled_diloco.obs.timeline", "load"),
    "GlobalEvaluator": "decoupled_diloco.local.evaluator",
    "MetricsWriter": "decoupled_diloco.obs.metrics",
    "write_report": "decoupled_diloco.obs.report",
    "SimConfig": "decoupled_diloco.sim",
    "simulate": "decoupled_diloco.sim",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = (
            _EXPORTS[name] if isinstance(_EXPORTS[name], tuple) else (_EXPORTS[name], name)
        )
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
