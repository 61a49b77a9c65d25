"""The inner optimizer: AdamW with linear warmup and cosine decay, built from the config."""

from __future__ import annotations

import jax
import optax

from decoupled_diloco.config import ExperimentConfig


def make_inner_optimizer(config: ExperimentConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW on a warmup + cosine schedule over `train_steps`.

    Weight decay skips vectors (norm scales): decaying them only fights the normalisation.
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
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(
            schedule,
            b1=o.b1,
            b2=o.b2,
            weight_decay=o.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )
