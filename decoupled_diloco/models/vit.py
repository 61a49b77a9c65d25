"""Vision transformer (ViT) classifier in Flax NNX.

Images (B, H, W, C) are cut into non-overlapping p×p patches, each flattened and projected to
d_model (`patch_embed`), plus a learned position embedding per patch (`pos_embed`). A stack of
pre-norm encoder blocks (bidirectional attention, SwiGLU MLP) follows; the mean of the patch
features, normalized, goes through a linear `head` to class logits. No class token: mean
pooling is as good at this size and keeps the sequence one patch grid.

Parameters carry the same `data`/`model` sharding annotations as the language model, so a ViT
island can be tensor-parallel over its `model` axis. Activations stay 2-D (N = B·patches, D)
as in `model.Transformer`, for XLA:CPU's fast GEMMs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from decoupled_diloco.config import ModelConfig
from decoupled_diloco.models.transformer import Block, Params, linear, sharded_init


def patchify(images_BHWC: jax.Array, patch: int) -> jax.Array:
    """(B, H, W, C) images to (B, H/p · W/p, p·p·C) patches, row-major over the patch grid."""
    b, h, w, c = images_BHWC.shape
    x = images_BHWC.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nnx.Module):
    """Maps images (B, H, W, C) to class logits (B, num_classes).

    Args:
      cfg: sizes (`d_model`, `num_layers`, `num_heads`, `mlp_hidden`, `patch_size`, `dtype`).
      image_shape: (H, W, C) of the images; `patch_size` must divide H and W.
      num_classes: classes of the task.
      rngs: initialization keys.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        image_shape: tuple[int, int, int],
        num_classes: int,
        rngs: nnx.Rngs,
    ):
        h, w, c = image_shape
        p = cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"config.model.patch_size: {p} does not divide images of {h}x{w}")
        dtype = jnp.dtype(cfg.dtype)
        self.patch_size = p
        self.num_patches = (h // p) * (w // p)
        self.patch_embed = linear(p * p * c, cfg.d_model, (None, "model"), dtype, rngs)
        self.pos_embed = nnx.Param(
            sharded_init((None, "model"))(
                rngs.params(), (self.num_patches, cfg.d_model), jnp.float32
            )
        )
        # Encoder blocks: bidirectional attention over the patches.
        self.blocks = nnx.List([Block(cfg, rngs, causal=False) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = linear(cfg.d_model, num_classes, ("model", None), dtype, rngs)

    def embed(self, images_BHWC: jax.Array) -> jax.Array:
        """Patch embeddings plus position embeddings, (B, patches, D)."""
        patches_BPK = patchify(images_BHWC, self.patch_size)
        x_BPD = self.patch_embed(patches_BPK)
        return x_BPD + self.pos_embed[...].astype(x_BPD.dtype)[None]

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        """Logits (B, num_classes) in float32."""
        batch = images_BHWC.shape[0]
        x_BPD = self.embed(images_BHWC)
        x_ND = x_BPD.reshape(-1, x_BPD.shape[-1])
        for block in self.blocks:
            x_ND = block(x_ND, batch)
        pooled_BD = jnp.mean(x_ND.reshape(batch, -1, x_ND.shape[-1]), axis=1)
        return self.head(self.final_norm(pooled_BD)).astype(jnp.float32)


def classification_metrics(
    graphdef: nnx.GraphDef, params: Params, batch: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Mean cross-entropy (`loss`, nats) and `accuracy` of `params` on an image batch."""
    model: Any = nnx.merge(graphdef, params)
    logits_BC = model(batch["image"])
    labels_B = batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BC, labels_B).mean()
    accuracy = jnp.mean((jnp.argmax(logits_BC, axis=-1) == labels_B).astype(jnp.float32))
    return {"loss": loss, "accuracy": accuracy}


def classification_loss(
    graphdef: nnx.GraphDef, params: Params, batch: dict[str, jax.Array]
) -> jax.Array:
    """Mean cross-entropy (nats): the training loss."""
    model: Any = nnx.merge(graphdef, params)
    logits_BC = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["label"]).mean()
