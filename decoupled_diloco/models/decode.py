"""Sampling from a language model: a KV cache, one compiled decode step, a batch of prompts.

    decoder = Decoder(model, context=config.model.seq_len)
    ids = decoder.generate([[5, 9, 2], [7]], max_new_tokens=64, temperature=0.8, top_k=40)

The prompts are right-aligned in one batch (the padding before a shorter prompt is masked out
of attention and its positions start at its first token). The prompts run through the model
once, filling every layer's cache (the prefill); then each new token is one call of the same
compiled step, its cache slot a traced argument, so nothing is compiled again per token
(`Decoder.compiles` counts). Any model with `embed`, `blocks` whose blocks `decode`
(`transformer.Block.decode`) and the built-in final norm and unembedding decodes here: the
built-in transformer and MoE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decoupled_diloco.models.transformer import Decoding, KVCache, final_logits


class GenerationError(ValueError):
    """A request the model cannot serve (too long a prompt, a bad setting); says which."""


def decode_tokens(
    model: Any, tokens_BT: jax.Array, caches: list[KVCache], at: Decoding
) -> tuple[jax.Array, list[KVCache]]:
    """Logits (B, T, V) of tokens written at cache slots `at.position`..., and the caches."""
    batch, steps = tokens_BT.shape
    x_ND = model.embed(tokens_BT.reshape(-1))
    updated = []
    for block, cache in zip(model.blocks, caches, strict=True):
        x_ND, cache = block.decode(x_ND, batch, cache, at)
        updated.append(cache)
    return final_logits(model, x_ND).reshape(batch, steps, -1), updated


def empty_caches(model: Any, batch: int, length: int) -> list[KVCache]:
    """One zeroed (B, length, heads, head size) key and value cache per layer."""
    attn = model.blocks[0].attn
    heads = attn.num_heads
    shape = (batch, length, heads, attn.q.out_features // heads)
    dtype = attn.q.dtype or jnp.float32
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in model.blocks]


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """Next tokens (B,): greedy at temperature 0, else drawn from the top `top_k` (0: all)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


class Decoder:
    """Generates from one model: its prefill and decode step, each compiled once per shape.

    Args:
      model: the language model (its parameters are read once, here).
      context: the longest sequence the model was trained on (`model.seq_len`): a prompt and
        its new tokens together may not exceed it (rotary positions past it were never seen).

    Raises:
      GenerationError: a model without a decode step.
    """

    def __init__(self, model: Any, context: int):
        blocks = getattr(model, "blocks", None)
        if (
            not hasattr(model, "embed")
            or not blocks
            or not all(hasattr(b, "decode") for b in blocks)
        ):
            raise GenerationError(
                f"{type(model).__name__} has no decode step (the built-in transformer and MoE "
                "have one: `embed`, and `blocks` that `decode` with a KV cache)"
            )
        self.graphdef, self.state = nnx.split(model)
        self.context = context
        self.vocab = model.embed.num_embeddings
        self.compiles = 0  # traces of the prefill and the step (each once per batch shape)

        def prefill(state, tokens_BT, caches, start_B):
            self.compiles += 1
            model = nnx.merge(self.graphdef, state)
            at = Decoding(jnp.int32(0), start_B)
            logits_BTV, caches = decode_tokens(model, tokens_BT, caches, at)
            return logits_BTV[:, -1], caches

        def step(state, tokens_B, caches, position, start_B, key, temperature, top_k):
            self.compiles += 1
            model = nnx.merge(self.graphdef, state)
            logits_BTV, caches = decode_tokens(
                model, tokens_B[:, None], caches, Decoding(position, start_B)
            )
            return sample(logits_BTV[:, 0], key, temperature, top_k), caches

        self._prefill = jax.jit(prefill)
        self._step = jax.jit(step, static_argnums=(6, 7))
        self._first = jax.jit(sample, static_argnums=(2, 3))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[list[int]]:
        """The `max_new_tokens` tokens that follow each prompt (token ids).

        Raises:
          GenerationError: an empty or out-of-vocabulary prompt, a prompt with its new tokens
            longer than the context, `temperature` < 0, `top_k` < 0 or `max_new_tokens` < 1.
        """
        self._check(prompts, max_new_tokens, temperature, top_k)
        longest = max(len(p) for p in prompts)
        tokens_BT = np.zeros((len(prompts), longest), np.int32)
        for b, prompt in enumerate(prompts):
            tokens_BT[b, longest - len(prompt) :] = prompt
        start_B = jnp.asarray([longest - len(p) for p in prompts], jnp.int32)
        caches = empty_caches(
            nnx.merge(self.graphdef, self.state), len(prompts), longest + max_new_tokens
        )
        last_BV, caches = self._prefill(self.state, jnp.asarray(tokens_BT), caches, start_B)
        keys = jax.random.split(jax.random.key(seed), max_new_tokens)
        token_B = self._first(last_BV, keys[0], float(temperature), int(top_k))
        out = [token_B]
        for i in range(1, max_new_tokens):
            position = jnp.int32(longest + i - 1)
            token_B, caches = self._step(
                self.state, token_B, caches, position, start_B, keys[i], float(temperature),
                int(top_k),
            )  # fmt: skip
            out.append(token_B)
        return np.stack(jax.device_get(out), axis=1).tolist()

    def _check(
        self, prompts: Sequence[Sequence[int]], new: int, temperature: float, top_k: int
    ) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        if new < 1:
            raise GenerationError(f"max_new_tokens={new}: at least 1")
        if not temperature >= 0:  # (NaN too)
            raise GenerationError(f"temperature={temperature}: must be >= 0 (0: greedy)")
        if top_k < 0 or top_k > self.vocab:
            raise GenerationError(f"top_k={top_k}: between 0 (all tokens) and {self.vocab}")
        longest = max(len(p) for p in prompts)
        if longest + new > self.context:
            raise GenerationError(
                f"a prompt of {longest} tokens and {new} new ones exceed the model's context of "
                f"{self.context} tokens (model.seq_len): shorten the prompt or max_new_tokens"
            )
        ids = np.concatenate([np.asarray(p) for p in prompts])
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise GenerationError(f"prompt token ids must be in [0, {self.vocab})")
