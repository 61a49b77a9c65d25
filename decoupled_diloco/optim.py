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

    def schedule(peak: float) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(config.train_steps, warmup + 1),
            end_value=peak * o.min_lr_ratio,
        )

    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    if o.name == "muon":
        # Muon steps the 2-D weights; the embedding tables (looked up, not multiplied) go to
        # AdamW with the vectors, as in Muon's reference recipe.
        inner = optax.contrib.muon(
            schedule(o.lr),
            beta=o.b1,
            weight_decay=o.weight_decay,
            weight_decay_mask=matrices,
            adam_b1=o.b1,
            adam_b2=o.b2,
            adam_weight_decay=0.0,
            adam_learning_rate=schedule(o.adam_lr or o.lr),
            muon_weight_dimension_numbers=_muon_dims,
        )
    else:
        inner = optax.adamw(
            schedule(o.lr), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=matrices
        )
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), inner)


def _muon_dims(params: optax.Params) -> optax.Params:
    """Muon's matrices: every 2-D weight but the embedding tables (those go to AdamW)."""

    def dims(path: tuple, p: jax.Array) -> optax.contrib.MuonDimensionNumbers | None:
        names = [str(getattr(k, "key", k)) for k in path]
        if p.ndim != 2 or any("embed" in n for n in names):
            return None
        return optax.contrib.MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1,))

    return jax.tree_util.tree_map_with_path(dims, params)
