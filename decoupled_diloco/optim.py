"""The built-in inner optimizer, from `config.optim`: AdamW or Muon, on warmup + cosine decay."""

from __future__ import annotations

import jax
import optax

from decoupled_diloco.config import ExperimentConfig


def make_inner_optimizer(config: ExperimentConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW (or Muon) on a warmup + cosine schedule over `train_steps`.

    Weight decay skips vectors (norm scales): decaying them only fights the normalisation.
    Muon (`optax.contrib.muon`) orthogonalises the momentum of every matrix and steps the other
    tensors with AdamW at the same learning rate.
    """
    o = config.optim
    warmup = min(o.warmup_steps, max(config.train_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(config.train_steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    if o.name == "muon":
        inner = optax.contrib.muon(
            schedule,
            beta=o.b1,
            weight_decay=o.weight_decay,
            weight_decay_mask=matrices,
            adam_b1=o.b1,
            adam_b2=o.b2,
        )
    else:
        inner = optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=matrices)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), inner)
