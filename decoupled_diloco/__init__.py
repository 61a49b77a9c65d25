"""decoupled_diloco: resilient, asynchronous, multi-island training in JAX.

The public surface, importable from Colab and research code:

    import decoupled_diloco as dd
    config = dd.ExperimentConfig(mode="diloco", num_learners=2, inner_steps=50)
    result = dd.train_and_evaluate(config, workdir="runs/mine")

Your own model, loss, optimizer and data (docs/byom.md):

    task = dd.Task.from_nnx(build_model=lambda rngs: CNN(rngs=rngs), loss_fn=my_loss)
    result = dd.train_and_evaluate(config, workdir, task=task, inner_optimizer=tx, dataset=data)

Everything else stays importable from its module (the package's layout is in docs/DESIGN.md),
e.g. `decoupled_diloco.sim.simulate`, `decoupled_diloco.chaos.faults.load`,
`decoupled_diloco.core.outer.merge_back`, `decoupled_diloco.local.launch.run_decoupled`.
"""

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = importlib.metadata.version("decoupled_diloco")
except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0+unknown"

# Public name -> defining module, or (module, its name there). Imported lazily (PEP 562) so that
# numpy-only parts, such as the goodput simulator or a syncer's config loading, do not pay for
# importing JAX.
_EXPORTS = {
    # Running an experiment: one entry point for every mode.
    "train_and_evaluate": "decoupled_diloco.train",
    "RunResult": "decoupled_diloco.train",
    # Fake CPU devices for a session that wants more learners than it has devices (before
    # JAX starts; `train_and_evaluate` does it itself when it can).
    "configure_cpu_devices": "decoupled_diloco.runtime",
    # Configuration.
    "ExperimentConfig": "decoupled_diloco.config",
    "ModelConfig": "decoupled_diloco.config",
    "DataConfig": "decoupled_diloco.config",
    "OptimConfig": "decoupled_diloco.config",
    "OuterConfig": "decoupled_diloco.config",
    "MeshConfig": "decoupled_diloco.config",
    "CheckpointConfig": "decoupled_diloco.config",
    "EvalConfig": "decoupled_diloco.config",
    "DecoupledConfig": "decoupled_diloco.config",
    "SyncerConfig": "decoupled_diloco.config",
    "CompressionConfig": "decoupled_diloco.config",
    "MoEConfig": "decoupled_diloco.config",
    "ConfigError": "decoupled_diloco.config",
    "from_config_dict": "decoupled_diloco.config",
    "as_config_dict": "decoupled_diloco.config",
    "validate": "decoupled_diloco.config",
    "replace": "decoupled_diloco.config",
    # What is trained: the task, its data, its islands, the synchronous DiLoCo trainer.
    "Task": "decoupled_diloco.tasks",
    "make_task": "decoupled_diloco.tasks",
    "Dataset": "decoupled_diloco.data.dataset",
    # Real corpora (docs/data.md): tokenize once into token shards, train on them.
    "prepare": "decoupled_diloco.data.prepare",
    "PreparedDataset": "decoupled_diloco.data.packed",
    "load_tokenizer": "decoupled_diloco.data.tokenizer",
    "train_bpe": "decoupled_diloco.data.tokenizer",
    "model_config": "decoupled_diloco.tasks",
    "make_inner_optimizer": "decoupled_diloco.optim",
    "Island": "decoupled_diloco.island",
    "DiLoCoOuter": "decoupled_diloco.trainers",
    "DiLoCoTrainer": "decoupled_diloco.trainers",
    # The decoupled processes, in one process or many.
    "Learner": "decoupled_diloco.learner.learner",
    "DecoupledSync": "decoupled_diloco.learner.sync",
    "SyncerServer": "decoupled_diloco.syncer.server",
    "SyncerClient": "decoupled_diloco.comm.client",
    # The client `DecoupledSync(client=)` takes: of one syncer, or of its S shards.
    "syncer_client": "decoupled_diloco.comm.shards",
    # The outer math every mode shares.
    "outer_gradient": "decoupled_diloco.core.outer",
    "outer_round": "decoupled_diloco.core.outer",
    # A trained model: its files, back as an nnx model, and text from it.
    "load_model": "decoupled_diloco.export",
    "generate": "decoupled_diloco.sample",
    # Goodput and reports.
    "analyze_goodput": ("decoupled_diloco.obs.timeline", "analyze"),
    "load_timeline": ("decoupled_diloco.obs.timeline", "load"),
    "write_report": "decoupled_diloco.obs.report",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the same names, eagerly, for IDEs and type checkers (tests/test_api.py)
    from decoupled_diloco.comm.client import SyncerClient
    from decoupled_diloco.comm.shards import syncer_client
    from decoupled_diloco.config import (
        CheckpointConfig,
        CompressionConfig,
        ConfigError,
        DataConfig,
        DecoupledConfig,
        EvalConfig,
        ExperimentConfig,
        MeshConfig,
        ModelConfig,
        MoEConfig,
        OptimConfig,
        OuterConfig,
        SyncerConfig,
        as_config_dict,
        from_config_dict,
        replace,
        validate,
    )
    from decoupled_diloco.core.outer import outer_gradient, outer_round
    from decoupled_diloco.data.dataset import Dataset
    from decoupled_diloco.data.packed import PreparedDataset
    from decoupled_diloco.data.prepare import prepare
    from decoupled_diloco.data.tokenizer import load_tokenizer, train_bpe
    from decoupled_diloco.export import load_model
    from decoupled_diloco.island import Island
    from decoupled_diloco.learner.learner import Learner
    from decoupled_diloco.learner.sync import DecoupledSync
    from decoupled_diloco.obs.report import write_report
    from decoupled_diloco.obs.timeline import analyze as analyze_goodput
    from decoupled_diloco.obs.timeline import load as load_timeline
    from decoupled_diloco.optim import make_inner_optimizer
    from decoupled_diloco.runtime import configure_cpu_devices
    from decoupled_diloco.sample import generate
    from decoupled_diloco.syncer.server import SyncerServer
    from decoupled_diloco.tasks import Task, make_task, model_config
    from decoupled_diloco.train import RunResult, train_and_evaluate
    from decoupled_diloco.trainers import DiLoCoOuter, DiLoCoTrainer


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
