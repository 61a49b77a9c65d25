"""Decoder-only transformer in Flax NNX: RMSNorm, rotary positions, SwiGLU, tied embeddings.

Parameters carry sharding annotations over the mesh axes `data` and `model`
(`nnx.with_partitioning`); the island turns them into `NamedSharding`s. Training code never
holds the module: it splits it once into a graph definition and a plain dict of parameters,
and calls `lm_loss(graphdef, params, batch)` inside `jax.jit`.

A batch from a prepared corpus packs several documents into a window; with their segment ids
and positions (`Segments`) attention stays within each document and rotary positions restart
at each one, so a token's logits do not depend on the other documents of its window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from decoupled_diloco.config import ModelConfig

Params = dict[str, Any]

_INIT_STD = 0.02


def sharded_init(spec: tuple[str | None, ...], std: float = _INIT_STD) -> nnx.Initializer:
    """Normal(0, std) initialization annotated with the mesh axes `spec` (every model's)."""
    return nnx.with_partitioning(nnx.initializers.normal(std), spec)


def linear(d_in: int, d_out: int, spec: tuple, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free linear layer whose kernel is sharded as `spec`."""
    kernel_init = sharded_init(spec)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=kernel_init, dtype=dtype, rngs=rngs)


def rotary(x_BTNH: jax.Array, base: float, positions_BT: jax.Array | None = None) -> jax.Array:
    """Applies rotary position embeddings to `x` at `positions` (default: 0, 1, ... along T)."""
    _, seq_len, _, head_dim = x_BTNH.shape
    inv_freq_F = 1.0 / base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if positions_BT is None:
        positions_BT = jnp.arange(seq_len)[None, :]
    angle_BTF = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_F
    sin_BT1F, cos_BT1F = jnp.sin(angle_BTF)[:, :, None, :], jnp.cos(angle_BTF)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], -1)
    return rotated.astype(x_BTNH.dtype)


class KVCache(NamedTuple):
    """One attention layer's keys and values of the tokens decoded so far (B, S, N, H)."""

    k_BSNH: jax.Array
    v_BSNH: jax.Array


class Decoding(NamedTuple):
    """Where a decoding call's tokens go in the caches.

    Prompts of different lengths are right-aligned: row b's tokens before `start_B[b]` are
    padding, masked out of attention, and its positions count from `start_B[b]`.
    """

    position: jax.Array  # () int32: the cache slot of this call's first token
    start_B: jax.Array  # (B,) int32: each row's first real token


class Segments(NamedTuple):
    """Packed documents in a batch of windows: which document each token is of, and where."""

    segment_ids_BT: jax.Array
    positions_BT: jax.Array


def document_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """(B, 1, T, T) bool: a query attends to earlier keys of its own segment only."""
    same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    causal_TT = jnp.tril(jnp.ones(same_BTT.shape[1:], bool))
    return (same_BTT & causal_TT)[:, None]


def attention_implementation(setting: str, dtype: str, head_dim: int = 64) -> str:
    """`jax.nn.dot_product_attention`'s implementation for `model.attention` on this backend.

    "auto": cuDNN's fused flash attention on GPUs for 16-bit compute (jax's own default is
    XLA's, which materialises the B·N·T² scores) where cuDNN takes the shape (head size a
    multiple of 8 up to 128) and the GPU (compute capability 8.0 or later); XLA's elsewhere
    (CPU, TPU, float32, older GPUs).
    """
    if setting != "auto":
        return setting
    if jax.default_backend() != "gpu" or jnp.dtype(dtype).itemsize != 2:
        return "xla"
    capability = getattr(jax.devices()[0], "compute_capability", None)  # e.g. "9.0"
    too_old = capability is not None and float(capability) < 8.0
    fits = head_dim % 8 == 0 and head_dim <= 128
    return "xla" if too_old or not fits else "cudnn"


class Attention(nnx.Module):
    """Multi-head self-attention: causal with rotary positions (the LMs), or bidirectional.

    `causal=False` is the ViT's encoder attention: every patch attends to every patch of its
    image, positions coming from the model's own embedding, not from rotary.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, causal: bool = True):
        dtype = jnp.dtype(cfg.dtype)
        self.num_heads, self.rope_base, self.causal = cfg.num_heads, cfg.rope_base, causal
        head_dim = cfg.d_model // cfg.num_heads
        self.implementation = attention_implementation(cfg.attention, cfg.dtype, head_dim)
        # One kernel each, columns head by head: a `model` axis dividing the heads gives every
        # device whole heads (a fused QKV kernel would be cut across q, k and v).
        self.q, self.k, self.v = (
            linear(cfg.d_model, cfg.d_model, (None, "model"), dtype, rngs) for _ in range(3)
        )
        self.out = linear(cfg.d_model, cfg.d_model, ("model", None), dtype, rngs)

    def __call__(self, x_ND: jax.Array, batch: int, segments: Segments | None = None) -> jax.Array:
        """Attends within each of the `batch` sequences of flattened tokens `x_ND`.

        Given `segments` (causal only), also within each document of a sequence only.
        """
        tokens, d_model = x_ND.shape
        shape = (batch, tokens // batch, self.num_heads, d_model // self.num_heads)
        q_BTNH, k_BTNH, v_BTNH = (f(x_ND).reshape(shape) for f in (self.q, self.k, self.v))
        mask = None
        if self.causal:
            positions = None if segments is None else segments.positions_BT
            q_BTNH = rotary(q_BTNH, self.rope_base, positions)
            k_BTNH = rotary(k_BTNH, self.rope_base, positions)
            if segments is not None:  # the causal mask within each document
                mask = document_mask(segments.segment_ids_BT)
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH,
            k_BTNH,
            v_BTNH,
            mask=mask,
            is_causal=self.causal and mask is None,
            implementation=self.implementation,
        )
        return self.out(o_BTNH.reshape(tokens, d_model))

    def decode(
        self, x_ND: jax.Array, batch: int, cache: KVCache, at: Decoding
    ) -> tuple[jax.Array, KVCache]:
        """Causal attention of this call's tokens over the cached ones and themselves.

        The tokens' keys and values are written into `cache` at `at.position` (the same
        projections and rotary positions as `__call__`); returns the output and the cache.
        """
        tokens, d_model = x_ND.shape
        steps = tokens // batch
        shape = (batch, steps, self.num_heads, d_model // self.num_heads)
        q_BTNH, k_BTNH, v_BTNH = (f(x_ND).reshape(shape) for f in (self.q, self.k, self.v))
        slots_T = at.position + jnp.arange(steps)
        positions_BT = slots_T[None, :] - at.start_B[:, None]
        q_BTNH = rotary(q_BTNH, self.rope_base, positions_BT)
        k_BTNH = rotary(k_BTNH, self.rope_base, positions_BT)
        at_slot = (0, at.position, 0, 0)
        cache = KVCache(
            jax.lax.dynamic_update_slice(cache.k_BSNH, k_BTNH.astype(cache.k_BSNH.dtype), at_slot),
            jax.lax.dynamic_update_slice(cache.v_BSNH, v_BTNH.astype(cache.v_BSNH.dtype), at_slot),
        )
        slots_S = jnp.arange(cache.k_BSNH.shape[1])
        visible_BTS = (slots_S[None, None, :] <= slots_T[None, :, None]) & (
            slots_S[None, None, :] >= at.start_B[:, None, None]
        )
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH, cache.k_BSNH.astype(q_BTNH.dtype), cache.v_BSNH.astype(q_BTNH.dtype),
            mask=visible_BTS[:, None], implementation="xla",
        )  # fmt: skip
        return self.out(o_BTNH.reshape(tokens, d_model)), cache


class SwiGLU(nnx.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.gate = linear(cfg.d_model, cfg.mlp_hidden, (None, "model"), dtype, rngs)
        self.up = linear(cfg.d_model, cfg.mlp_hidden, (None, "model"), dtype, rngs)
        self.down = linear(cfg.mlp_hidden, cfg.d_model, ("model", None), dtype, rngs)

    def __call__(self, x_ND: jax.Array) -> jax.Array:
        """Applies the gated MLP to each token."""
        return self.down(jax.nn.silu(self.gate(x_ND)) * self.up(x_ND))


class Block(nnx.Module):
    """Pre-norm transformer block on flattened tokens (N = B*T, D).

    `causal`: causal attention with rotary positions (the LMs); False: bidirectional (the
    ViT's encoder blocks).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, causal: bool = True):
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs, causal=causal)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x_ND: jax.Array, batch: int, segments: Segments | None = None) -> jax.Array:
        """Residual attention, then residual MLP."""
        attn_args = (batch,) if segments is None else (batch, segments)
        x_ND = x_ND + self.attn(self.attn_norm(x_ND), *attn_args)
        return x_ND + self.mlp(self.mlp_norm(x_ND))

    def decode(
        self, x_ND: jax.Array, batch: int, cache: KVCache, at: Decoding
    ) -> tuple[jax.Array, KVCache]:
        """`__call__` for decoding: attention over the cache (`Attention.decode`)."""
        h_ND, cache = self.attn.decode(self.attn_norm(x_ND), batch, cache, at)
        x_ND = x_ND + h_ND
        return x_ND + self.mlp(self.mlp_norm(x_ND)), cache


class Transformer(nnx.Module):
    """Decoder-only language model mapping token ids (B, T) to logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        check_vocab(cfg)
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=sharded_init((None, "model")),
            dtype=dtype,
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.remat = cfg.remat  # recompute each block's activations in the backward pass
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.unembed = (
            None
            if cfg.tie_embeddings
            else linear(cfg.d_model, cfg.vocab_size, (None, "model"), dtype, rngs)
        )

    def __call__(self, tokens_BT: jax.Array, segments: Segments | None = None) -> jax.Array:
        """Logits (B, T, V) for token ids (B, T), within documents given their `segments`."""
        batch, seq_len = tokens_BT.shape
        # Activations stay 2-D (N = B*T tokens): XLA:CPU runs dots with one contracting
        # dimension as fast GEMMs, but ones contracting over (B, T) in the backward pass
        # several times slower (measured 160 -> 127 ms/step for the MLP alone).
        x_ND = self.embed(tokens_BT.reshape(-1))
        for block in self.blocks:
            x_ND = (_remat_block if self.remat else _block)(block, x_ND, batch, segments)
        return final_logits(self, x_ND).reshape(batch, seq_len, -1)


def final_logits(model: Any, x_ND: jax.Array) -> jax.Array:
    """A language model's final norm and (tied) unembedding: float32 logits (N, V)."""
    x_ND = model.final_norm(x_ND)
    logits_NV = model.embed.attend(x_ND) if model.unembed is None else model.unembed(x_ND)
    return logits_NV.astype(jnp.float32)


def _block(block: Block, x_ND: jax.Array, batch: int, segments: Segments | None) -> jax.Array:
    return block(x_ND, batch, segments)


# Activation memory of one block instead of all: its inside is recomputed for the gradient.
_remat_block = nnx.remat(_block, static_argnums=(2,))


def check_vocab(cfg: ModelConfig) -> None:
    """Refuses a model whose vocabulary was never resolved from its data (`vocab_size` 0)."""
    if cfg.vocab_size < 1:
        raise ValueError(
            "ModelConfig.vocab_size is 0 (take it from the data): build the model through "
            "dd.make_task(config), or give the size with dd.model_config(config)"
        )


def split_batch(batch: Any, document_mask: bool) -> tuple[jax.Array, Segments | None]:
    """(tokens (B, T+1), their segments or None) of a batch: an array, or a packed dict.

    A dict (a prepared corpus: `tokens`, `segment_ids`, `positions`) gives segments when
    `document_mask` is on; an array (the byte corpus) never does.
    """
    if not isinstance(batch, dict):
        return batch, None
    if not document_mask:
        return batch["tokens"], None
    return batch["tokens"], Segments(batch["segment_ids"], batch["positions"])


def inputs(batch: Any, document_mask: bool) -> tuple[jax.Array, Segments | None, jax.Array]:
    """(input ids (B, T), their segments, next-token labels (B, T)) of a batch."""
    tokens_BT1, segments = split_batch(batch, document_mask)
    if segments is not None:
        segments = Segments(segments.segment_ids_BT[:, :-1], segments.positions_BT[:, :-1])
    return tokens_BT1[:, :-1], segments, tokens_BT1[:, 1:]


def lm_loss(
    graphdef: nnx.GraphDef, params: Params, batch: Any, document_mask: bool = True
) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a batch of (B, T+1) windows under `params`.

    Args:
      graphdef: the model's graph.
      params: its parameters.
      batch: token ids (B, T+1), or a packed dict (`split_batch`).
      document_mask: attend within each packed document only.
    """
    model = nnx.merge(graphdef, params)
    tokens_BT, segments, labels_BT = inputs(batch, document_mask)
    logits_BTV = model(tokens_BT, segments)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT).mean()


def is_embedding(path: tuple[str, ...]) -> bool:
    """Whether a parameter path names an (un)embedding table, merged by plain mean (not RDA)."""
    return any(name in ("embed", "unembed") for name in path)


def count_params(params: Params) -> int:
    """Number of scalar parameters in a parameter tree."""
    return sum(x.size for x in jax.tree.leaves(params))
