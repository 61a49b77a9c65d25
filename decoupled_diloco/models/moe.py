"""Mixture-of-experts decoder LM in Flax NNX: top-k routed SwiGLU experts with capacity.

The model is the dense `model.Transformer` with every block's MLP replaced by `MoEMLP`:
  * A router (a linear map to E logits, in float32) picks each token's top-k experts (k = 1:
    Switch; k = 2: GShard, gates renormalized over the two). With k = 1 the gate is the router
    probability itself, so the router gets gradient through the output.
  * Routing groups are sequences: expert e takes at most C = ceil(k·T·capacity_factor / E)
    tokens of each sequence. Every token's first choice is placed before any token's second
    choice, then in token order; a token past capacity skips that expert (the residual carries
    it). Groups per sequence make routing independent of the batch size, so dp (one big batch)
    and M islands (M small ones) route identically.
  * Losses added to the training loss (summed over layers): the load-balancing loss
    E·Σ_e f_e·P_e (f_e: share of tokens whose first choice is e; P_e: mean router probability;
    1 for uniform routing) and the router z-loss mean(logsumexp(logits)²) (ST-MoE).

Expert placement: the experts' weights are stacked, expert axis first, one tensor per layer and
weight, annotated `(EXPERT_AXIS, None, None)` with EXPERT_AXIS = "model". The island mesh keeps
its two axes (`data`, `model`): the model axis doubles as the expert axis, so an island with a
model axis of size m holds E/m experts per device (config validation checks m divides E), and
XLA inserts the all-to-alls of expert parallelism. Attention stays tensor-parallel over the same
axis. No third mesh axis is needed, and nothing else in the framework changes.

Merging: the stacked expert tensors, the router and everything else go through fragments,
compression and the outer merge like any tensor. With `rda` a stacked expert tensor is merged
as one tensor, its direction normalized as a whole. What that does to rarely used experts:
  * An expert no learner routed to has a zero outer gradient in every learner (weight decay
    aside) and gets exactly zero merged update: RDA amplifies nothing out of nothing.
  * A rarely used expert's rows enter the tensor's mean direction with their own (small) size
    next to the trained experts' rows, and are rescaled by the same factor as the whole tensor.
Had each expert been a tensor of its own, RDA would normalize a rarely used expert's small,
noise-like outer gradients (a few stray gradients, which Adam turns into full-size steps) on
their own and restore them to their mean norm even when the learners' noise disagrees, about
√M times what the mean gives. So experts stay stacked. `tests/test_moe.py` checks both points.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from decoupled_diloco.config import ModelConfig, MoEConfig
from decoupled_diloco.models.transformer import (
    Attention,
    Decoding,
    KVCache,
    Params,
    Segments,
    check_vocab,
    final_logits,
    inputs,
    sharded_init,
)

EXPERT_AXIS = "model"  # The island mesh axis the expert dimension is sharded over.


def expert_capacity(group_size: int, num_experts: int, top_k: int, factor: float) -> int:
    """Tokens one expert takes from a group of `group_size`: ceil(k·S·factor / E), at least 1."""
    return max(1, math.ceil(top_k * group_size * factor / num_experts))


class Routing(NamedTuple):
    """Where each token goes, with what weight, and the router's auxiliary losses.

    dispatch_GSEC is 1 where token s of group g takes slot c of expert e; combine_GSEC holds the
    gate there. load_balance and z_loss are scalars; dropped is the share of token choices that
    found their expert full.
    """

    dispatch_GSEC: jax.Array
    combine_GSEC: jax.Array
    load_balance: jax.Array
    z_loss: jax.Array
    dropped: jax.Array


def route(logits_GSE: jax.Array, top_k: int, capacity: int) -> Routing:
    """Top-k routing with a per-group capacity (priority: choice rank, then token order)."""
    logits_GSE = logits_GSE.astype(jnp.float32)
    groups, size, num_experts = logits_GSE.shape
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    gates_GSK, experts_GSK = jax.lax.top_k(probs_GSE, top_k)
    if top_k > 1:  # GShard: the chosen experts' gates sum to one.
        gates_GSK = gates_GSK / jnp.sum(gates_GSK, axis=-1, keepdims=True)
    mask_GSKE = jax.nn.one_hot(experts_GSK, num_experts, dtype=jnp.float32)
    # Slot of each choice in its expert's buffer: count earlier claims, all first choices
    # before any second choice (so a second choice never pushes out a first one).
    mask_GKSE = mask_GSKE.transpose(0, 2, 1, 3)
    claims = mask_GKSE.reshape(groups, top_k * size, num_experts)
    slot_GKSE = (jnp.cumsum(claims, axis=1) - 1.0).reshape(mask_GKSE.shape)
    slot_GSKE = slot_GKSE.transpose(0, 2, 1, 3)
    kept_GSKE = mask_GSKE * (slot_GSKE < capacity)
    # one_hot of a slot >= capacity is all zeros; kept_GSKE also zeroes the unchosen experts.
    place_GSKEC = jax.nn.one_hot(slot_GSKE.astype(jnp.int32), capacity) * kept_GSKE[..., None]
    dispatch_GSEC = jnp.sum(place_GSKEC, axis=2)
    combine_GSEC = jnp.sum(gates_GSK[..., None, None] * place_GSKEC, axis=2)
    first_choice_E = jnp.mean(mask_GSKE[:, :, 0], axis=(0, 1))
    mean_prob_E = jnp.mean(probs_GSE, axis=(0, 1))
    load_balance = num_experts * jnp.sum(first_choice_E * mean_prob_E)
    z_loss = jnp.mean(jax.nn.logsumexp(logits_GSE, axis=-1) ** 2)
    dropped = 1.0 - jnp.sum(kept_GSKE) / (groups * size * top_k)
    return Routing(dispatch_GSEC, combine_GSEC, load_balance, z_loss, dropped)


class MoEMLP(nnx.Module):
    """Top-k routed SwiGLU experts on sequences (G, S, D); returns (output, Routing)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        e, d, f = moe.num_experts, cfg.d_model, cfg.mlp_hidden
        self.top_k, self.capacity_factor, self.dtype = moe.top_k, moe.capacity_factor, dtype
        # The router is small and replicated; its logits are float32 whatever the dtype.
        self.router = nnx.Linear(
            d,
            e,
            use_bias=False,
            kernel_init=sharded_init((None, None)),
            dtype=jnp.float32,
            rngs=rngs,
        )
        key = rngs.params
        self.gate = nnx.Param(
            sharded_init((EXPERT_AXIS, None, None))(key(), (e, d, f), jnp.float32)
        )
        self.up = nnx.Param(sharded_init((EXPERT_AXIS, None, None))(key(), (e, d, f), jnp.float32))
        self.down = nnx.Param(
            sharded_init((EXPERT_AXIS, None, None))(key(), (e, f, d), jnp.float32)
        )

    def __call__(self, x_GSD: jax.Array) -> tuple[jax.Array, Routing]:
        """Each token's gated sum of its experts' outputs (zero where every choice was full)."""
        _, size, _ = x_GSD.shape
        num_experts = self.gate.shape[0]
        capacity = expert_capacity(size, num_experts, self.top_k, self.capacity_factor)
        routing = route(self.router(x_GSD), self.top_k, capacity)
        dtype = self.dtype
        dispatch = routing.dispatch_GSEC.astype(dtype)
        x_EGCD = jnp.einsum("gsec,gsd->egcd", dispatch, x_GSD.astype(dtype))
        gate_EDF, up_EDF, down_EFD = (w[...].astype(dtype) for w in (self.gate, self.up, self.down))
        h_EGCF = jax.nn.silu(jnp.einsum("egcd,edf->egcf", x_EGCD, gate_EDF)) * jnp.einsum(
            "egcd,edf->egcf", x_EGCD, up_EDF
        )
        y_EGCD = jnp.einsum("egcf,efd->egcd", h_EGCF, down_EFD)
        y_GSD = jnp.einsum("gsec,egcd->gsd", routing.combine_GSEC.astype(dtype), y_EGCD)
        return y_GSD, routing


class MoEBlock(nnx.Module):
    """Pre-norm block: residual attention, then residual routed experts."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.moe = MoEMLP(cfg, moe, rngs)

    def __call__(
        self, x_ND: jax.Array, batch: int, segments: Segments | None = None
    ) -> tuple[jax.Array, Routing]:
        """Applies the block to flattened tokens (N = B*T, D); routing groups are sequences."""
        x_ND = x_ND + self.attn(self.attn_norm(x_ND), batch, segments)
        h_GSD = self.mlp_norm(x_ND).reshape(batch, -1, x_ND.shape[-1])
        y_GSD, routing = self.moe(h_GSD)
        return x_ND + y_GSD.reshape(x_ND.shape).astype(x_ND.dtype), routing

    def decode(
        self, x_ND: jax.Array, batch: int, cache: KVCache, at: Decoding
    ) -> tuple[jax.Array, KVCache]:
        """`__call__` for decoding: attention over the cache; each token routed on its own.

        A routing group of one token: no token is dropped for capacity (in training a group is
        a sequence, whose tokens compete for each expert's slots), and the padding before a
        shorter prompt takes no slot from real tokens.
        """
        h_ND, cache = self.attn.decode(self.attn_norm(x_ND), batch, cache, at)
        x_ND = x_ND + h_ND
        y_GSD, _ = self.moe(self.mlp_norm(x_ND)[:, None, :])
        return x_ND + y_GSD.reshape(x_ND.shape).astype(x_ND.dtype), cache


class MoETransformer(nnx.Module):
    """Decoder-only MoE LM: token ids (B, T) to logits (B, T, V) and per-layer routings."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        check_vocab(cfg)
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=sharded_init((None, "model")),
            dtype=dtype,
            rngs=rngs,
        )  # fmt: skip
        self.blocks = nnx.List([MoEBlock(cfg, moe, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.unembed = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                kernel_init=sharded_init((None, "model")),
                dtype=dtype,
                rngs=rngs,
            )  # fmt: skip
        )

    def __call__(
        self, tokens_BT: jax.Array, segments: Segments | None = None
    ) -> tuple[jax.Array, list[Routing]]:
        """Logits (B, T, V) in float32 and each layer's routing (within documents, if given)."""
        batch, seq_len = tokens_BT.shape
        x_ND = self.embed(tokens_BT.reshape(-1))
        routings = []
        for block in self.blocks:
            x_ND, routing = block(x_ND, batch, segments)
            routings.append(routing)
        return final_logits(self, x_ND).reshape(batch, seq_len, -1), routings


def moe_lm_metrics(
    graphdef: nnx.GraphDef, params: Params, batch: Any, document_mask: bool = True
) -> dict[str, jax.Array]:
    """Next-token cross-entropy (`loss`) and the router's losses, summed over layers.

    `batch`: token ids (B, T+1) or a packed dict (`transformer.split_batch`).
    """
    model: Any = nnx.merge(graphdef, params)
    tokens_BT, segments, labels_BT = inputs(batch, document_mask)
    logits_BTV, routings = model(tokens_BT, segments)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT).mean()
    return {
        "loss": ce,
        "moe_load_balance": sum(r.load_balance for r in routings),
        "moe_z_loss": sum(r.z_loss for r in routings),
        "moe_dropped": sum(r.dropped for r in routings) / len(routings),
    }


def moe_lm_loss(
    graphdef: nnx.GraphDef, params: Params, batch: Any, moe: MoEConfig, document_mask: bool = True
) -> jax.Array:
    """The training loss: cross-entropy + weighted load-balancing and router z-losses."""
    m = moe_lm_metrics(graphdef, params, batch, document_mask)
    return (
        m["loss"]
        + moe.aux_loss_weight * m["moe_load_balance"]
        + (moe.z_loss_weight * m["moe_z_loss"])
    )
