r"""Your own training loop, synced by decoupled_diloco: a nanoGPT-style byte LM.

The model, the data loader, the optimizer and the jitted step are the user's; `dd.DecoupledSync`
does only fragments, pushes, pulls and merges. Start a syncer from the command line (it builds the
same model from this file's `make_task`), then one process per learner:

  export DD_RUN_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
  python -m decoupled_diloco.syncer --config=experiments/examples/own_loop.py --port=50051 &
  python -m experiments.examples.own_loop --config=experiments/examples/own_loop.py \
      --syncer=127.0.0.1:50051 --learner_id=0 &
  python -m experiments.examples.own_loop --config=experiments/examples/own_loop.py \
      --syncer=127.0.0.1:50051 --learner_id=1

Both sides read the same config (this file's `get_config`, with the same `--config.X` overrides).
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import decoupled_diloco as dd

TASK = "experiments.examples.own_loop:make_task"


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """The block applied to a (B, T, D) residual stream."""
        causal = nnx.make_causal_mask(jnp.ones(x_BTD.shape[:2]))
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD), mask=causal)
        return x_BTD + self.down(nnx.gelu(self.up(self.norm2(x_BTD))))


class ByteGPT(nnx.Module):
    """Token and position embeddings, `depth` blocks, a final norm, the tied output head."""

    def __init__(self, seq_len: int, width: int, depth: int, heads: int, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(256, width, rngs=rngs)
        self.positions = nnx.Embed(seq_len, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        """Next-byte logits (B, T, 256)."""
        x_BTD = self.tokens(tokens_BT) + self.positions(jnp.arange(tokens_BT.shape[1]))
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.tokens.attend(self.norm(x_BTD))


def next_byte_loss(model: ByteGPT, tokens_BT1: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats)."""
    logits_BTV = model(tokens_BT1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT1[:, 1:]).mean()


def build(config, rngs: nnx.Rngs) -> ByteGPT:
    """The model of `config.model` (seq_len, d_model, num_layers, num_heads)."""
    m = config.model
    return ByteGPT(m.seq_len, m.d_model, m.num_layers, m.num_heads, rngs=rngs)


def make_task(config) -> dd.Task:
    """What the syncer needs to know: the model (its tree and initial values) and the loss."""
    return dd.Task.from_nnx(
        build_model=lambda rngs: build(config, rngs),
        loss_fn=next_byte_loss,
        # The embedding tables are merged by the plain mean, as Decoupled DiLoCo does.
        is_mean_only=lambda name: name.startswith(("tokens/", "positions/")),
        tokens_per_example=config.model.seq_len,
        token_unit="tokens",
    )


def get_config():
    """Two learners, four fragments synced every H = 20 steps, 200 steps each."""
    return dd.as_config_dict(
        dd.ExperimentConfig(
            mode="decoupled",
            num_learners=2,
            inner_steps=20,
            train_steps=200,
            task=TASK,
            model=dd.ModelConfig(seq_len=64, d_model=64, num_layers=2, num_heads=4),
            data=dd.DataConfig(batch_size=16),
            outer=dd.OuterConfig(lr=1.0, momentum=0.0, nesterov=False, merge="rda"),
        )
    )


def byte_windows(learner_id: int, seq_len: int, batch_size: int, seed: int = 0):
    """Endless batches of random (seq_len + 1)-byte windows of the Python standard library."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:200]
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    rng = np.random.default_rng(seed * 1000 + learner_id)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        yield np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def train(config, syncer: str, learner_id: int, log_every: int = 20) -> dict:
    """One learner's own loop; returns its first and last losses and the versions it saw."""
    model = build(config, nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(nnx.to_pure_dict(params))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, config.train_steps)),
    )
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens_BT1):
        loss, grads = jax.value_and_grad(
            lambda p: next_byte_loss(nnx.merge(graphdef, p), tokens_BT1)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    batches = byte_windows(learner_id, config.model.seq_len, config.data.batch_size, config.seed)
    tokens = config.data.batch_size * config.model.seq_len
    with dd.DecoupledSync(config, learner_id=learner_id, syncer=syncer, params=params) as sync:
        for i in range(1, config.train_steps + 1):
            params = sync.apply_arrivals(params)  # the global values first, then merges
            params, opt_state, loss = step(params, opt_state, next(batches))
            sync.step_done(params, tokens=tokens, loss=loss)
            if i % log_every == 0 or i == 1:
                losses.append(float(loss))
                print(f"[own_loop {learner_id}] step {i} loss {losses[-1]:.3f} "
                      f"versions {sync.versions}", flush=True)  # fmt: skip
    return {"first_loss": losses[0], "last_loss": losses[-1], "versions": sync.versions}


def main(argv: list[str]) -> None:
    """Runs one learner's loop against --syncer."""
    del argv
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)
    config = dd.from_config_dict(flags.FLAGS.config)
    result = train(config, flags.FLAGS.syncer, flags.FLAGS.learner_id)
    print(f"[own_loop {flags.FLAGS.learner_id}] done: {result}", flush=True)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "experiments/examples/own_loop.py")
    flags.DEFINE_string("syncer", "127.0.0.1:50051", "HOST:PORT of the syncer.")
    flags.DEFINE_integer("learner_id", 0, "This learner's index.")
    sys.exit(app.run(main))
