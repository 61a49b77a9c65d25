"""Sampling with a KV cache: the same tokens as the model without one, one compiled step."""

import jax
import numpy as np
import pytest
from flax import nnx

from decoupled_diloco import config as config_lib
from decoupled_diloco.models import moe as moe_lib
from decoupled_diloco.models.decode import Decoder, GenerationError
from decoupled_diloco.models.mesh import make_island_mesh
from decoupled_diloco.models.transformer import Transformer

CFG = config_lib.ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_hidden=64, seq_len=32
)


def _built(build):
    with jax.set_mesh(make_island_mesh((1, 1), jax.devices()[:1])):  # the annotations need one
        return build()


@nnx.jit
def _forward(model, tokens_BT):
    logits = model(tokens_BT)
    return logits[0] if isinstance(logits, tuple) else logits  # (the MoE's routings apart)


def _greedy_without_cache(model, prompt, new):
    """Greedy decoding by running the whole sequence through the model for every token.

    Padded to the context after its end (causal: no earlier position sees it), so the forward
    pass compiles once.
    """
    tokens = list(prompt)
    for _ in range(new):
        padded = np.zeros((1, CFG.seq_len), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = np.asarray(_forward(model, padded))
        tokens.append(int(np.argmax(logits[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def model():
    return _built(lambda: Transformer(CFG, nnx.Rngs(3)))


def test_cached_greedy_decoding_gives_the_tokens_of_the_full_forward_pass(model):
    decoder = Decoder(model, context=CFG.seq_len)
    prompts = [[5, 9, 2, 40, 11], [7], [1, 2, 3]]  # of different lengths, in one batch
    got = decoder.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert got == [_greedy_without_cache(model, p, 12) for p in prompts]
    assert decoder.compiles == 2  # the prefill and the step, not one per token
    decoder.generate([[3, 4], [8, 8]], max_new_tokens=20, temperature=0.0)
    assert decoder.compiles == 4  # another batch shape: compiled once more, each


def test_moe_decodes_with_a_cache_too():
    moe_cfg = config_lib.MoEConfig(num_experts=4, top_k=2, capacity_factor=8.0)  # none dropped
    model = _built(lambda: moe_lib.MoETransformer(CFG, moe_cfg, nnx.Rngs(0)))
    got = Decoder(model, context=CFG.seq_len).generate([[4, 5, 6]], 6, temperature=0.0)
    assert got == [_greedy_without_cache(model, [4, 5, 6], 6)]


def test_sampling_is_seeded_and_top_k_keeps_to_the_likeliest(model):
    decoder = Decoder(model, context=CFG.seq_len)
    first = decoder.generate([[1, 2]], 8, temperature=1.0, top_k=3, seed=1)
    assert first == decoder.generate([[1, 2]], 8, temperature=1.0, top_k=3, seed=1)
    assert first != decoder.generate([[1, 2]], 8, temperature=1.0, top_k=3, seed=2)
    logits = np.asarray(_forward(model, np.asarray([[1, 2]], np.int32)))[0, -1]
    assert first[0][0] in set(np.argsort(logits)[-3:].tolist())


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[1] * 30], {"max_new_tokens": 3}, "exceed the model's context of 32"),
        ([[1]], {"max_new_tokens": 3, "temperature": -0.5}, "temperature=-0.5"),
        ([[1]], {"max_new_tokens": 3, "top_k": -1}, "top_k=-1"),
        ([[]], {"max_new_tokens": 3}, "at least one token"),
        ([[64]], {"max_new_tokens": 3}, r"in \[0, 64\)"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens=0"),
    ],
)
def test_bad_requests_are_named(model, prompts, kwargs, match):
    with pytest.raises(GenerationError, match=match):
        Decoder(model, context=CFG.seq_len).generate(prompts, **kwargs)


def test_moe_decodes_each_prompt_as_alone_whatever_its_batch_and_capacity():
    moe_cfg = config_lib.MoEConfig(num_experts=4, top_k=1, capacity_factor=0.5)  # tight
    model = _built(lambda: moe_lib.MoETransformer(CFG, moe_cfg, nnx.Rngs(1)))
    decoder = Decoder(model, context=CFG.seq_len)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]  # the short one padded in the batch
    together = decoder.generate(prompts, 6, temperature=0.0)
    assert together == [decoder.generate([p], 6, temperature=0.0)[0] for p in prompts]
