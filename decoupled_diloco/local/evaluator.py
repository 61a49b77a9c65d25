"""The global model's evaluation during and after a decoupled run: pulled from the syncer."""

from __future__ import annotations

from typing import Any

import jax

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.core import fragments
from decoupled_diloco.data.dataset import describe, load_dataset
from decoupled_diloco.data.heldout import evaluate_sets, held_out_sets
from decoupled_diloco.island import Island


class GlobalEvaluator:
    """Evaluates the syncer's global parameters (pulled fragment by fragment) on one device.

    Learner-kept state (`state_policy="local"`) is not on the syncer: the global model is then
    evaluated with a freshly initialised model's (docs/byom.md).
    """

    def __init__(
        self,
        config: config_lib.ExperimentConfig,
        client: SyncerClient,
        corpus: Any,
        task: Any = None,
    ):
        self.config, self.client = config, client
        self.island = Island(config, jax.devices()[:1], mesh_shape=(1, 1), task=task)
        specs = fragments.tensor_specs(self.island.abstract_params)
        self.partition = fragments.partition(specs, config.decoupled.fragments)
        self.num_leaves = len(specs)
        dataset = load_dataset(config, corpus, self.island.task)
        self.data_key, self.data_facts = describe(dataset)  # for the run's summary
        self.sets = held_out_sets(config, dataset)
        self.metrics: dict[str, float] = {}

    def params(self) -> Any:
        """The current global parameters, as a host pytree."""
        leaves: list[Any] = [None] * self.num_leaves
        for p, fragment in enumerate(self.partition):
            _, values = self.client.pull(-1, p, 0, self.config.decoupled.syncer.rpc_timeout_s)
            for spec, value in zip(fragment, values, strict=True):
                leaves[spec.index] = value
        return jax.tree.unflatten(jax.tree.structure(self.island.abstract_params), leaves)

    def __call__(self) -> tuple[Any, float]:
        """(global parameters, their mean validation loss); all metrics go to `metrics`.

        `metrics` holds the loss and the task's other metrics, and bits per byte (`bpb`) where
        the data knows its bytes, for the run's held-out set and each of `eval.sets`
        (`data.heldout`).
        """
        params = self.params()
        self.metrics = evaluate_sets(
            self.sets, lambda batches: self.island.evaluate_metrics(params, batches)
        )
        return params, self.metrics["loss"]

    def event(self) -> dict[str, float]:
        """The last evaluation as metrics fields: eval_loss and every other metric of the task."""
        return {f"eval_{k}": v for k, v in self.metrics.items()}
