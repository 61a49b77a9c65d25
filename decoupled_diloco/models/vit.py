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
from decoupled_diloco.models.transformer import Block, Params, attention_implementation

_INIT_STD = 0.02


def _init(spec: tuple[str | None, ...]) -> nnx.Initializer:
    return nnx.with_partitioning(nnx.initializers.normal(_INIT_STD), spec)


def _linear(d_in: int, d_out: int, spec: tuple, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=_init(spec), dtype=dtype, rngs=rngs)


def patchify(images_BHWC: jax.Array, patch: int) -> jax.Array:
    """(B, H, W, C) images to (B, H/p · W/p, p·p·C) patches, row-major over the patch grid."""
    b, h, w, c = images_BHWC.shape
    x = images_BHWC.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class EncoderAttention(nnx.Module):
    """Bidirectional multi-head self-attention (positions come from `pos_embed`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.num_heads = cfg.num_heads
        head_dim = cfg.d_model // cfg.num_heads
        self.implementation = attention_implementation(cfg.attention, cfg.dtype, head_dim)
        # Separate kernels, heads whole on each `model` shard (as `transformer.Attention`).
        self.q, self.k, self.v = (
            _linear(cfg.d_model, cfg.d_model, (None, "model"), dtype, rngs) for _ in range(3)
        )
        self.out = _linear(cfg.d_model, cfg.d_model, ("model", None), dtype, rngs)

    def __call__(self, x_ND: jax.Array, batch: int) -> jax.Array:
        """Attends within each of the `batch` images' patch sequences."""
        tokens, d_model = x_ND.shape
        shape = (batch, tokens // batch, self.num_heads, d_model // self.num_heads)
        q_BTNH, k_BTNH, v_BTNH = (f(x_ND).reshape(shape) for f in (self.q, self.k, self.v))
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BTNH, v_BTNH, implementation=self.implementation
        )
        return self.out(o_BTNH.reshape(tokens, d_model))


class EncoderBlock(Block):
    """Pre-norm encoder block on flattened patches (N = B·patches, D): bidirectional attention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, attention=EncoderAttention)


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
        self.patch_embed = _linear(p * p * c, cfg.d_model, (None, "model"), dtype, rngs)
        self.pos_embed = nnx.Param(
            _init((None, "model"))(rngs.params(), (self.num_patches, cfg.d_model), jnp.float32)
        )
        self.blocks = nnx.List([EncoderBlock(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = _linear(cfg.d_model, num_classes, ("model", None), dtype, rngs)

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
