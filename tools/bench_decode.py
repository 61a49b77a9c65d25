"""Decoding speed on CPU: tokens per second with the KV cache, against the forward pass without.

  python -m tools.bench_decode --out=benchmarks/results/decode.md

For `tiny_lm` and `lm_125m` (its bfloat16 compute, float32 parameters; initialised weights:
the speed does not depend on their values): a batch of prompts of `--prompt` tokens, then
`--new` tokens each, greedy. With the cache (`models.decode.Decoder`): one prefill, then one
compiled step per token. Without it: the whole sequence through the model for every new token
(padded to the final length, so that it too compiles once), as a loop without a cache does.
Each timing is the best of `--repeats` after one untimed run (the compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from decoupled_diloco import config as config_lib
from decoupled_diloco import tasks
from decoupled_diloco.models.decode import Decoder
from decoupled_diloco.models.mesh import make_island_mesh
from experiments.configs import lm, tiny_lm
from tools.benchkit import Section

MODELS = {"tiny_lm": tiny_lm.get_config, "lm_125m": lambda: lm.get_config("125m")}


@nnx.jit
def _forward(model, tokens_BT):
    return model(tokens_BT)


def _without_cache(model, prompts_BT: np.ndarray, new: int) -> None:
    batch, length = prompts_BT.shape
    tokens = np.zeros((batch, length + new), np.int32)
    tokens[:, :length] = prompts_BT
    for i in range(new):
        logits = np.asarray(_forward(model, tokens))  # (B, T, V), on the host
        tokens[:, length + i] = logits[:, length + i - 1].argmax(-1)


def _best(fn, repeats: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(name: str, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """Seconds for `new` tokens per row, with the cache and without."""
    config = config_lib.from_config_dict(MODELS[name]())
    config = dataclasses.replace(config, model=tasks.model_config(config))
    with jax.set_mesh(make_island_mesh((1, 1), jax.devices()[:1])):
        model = tasks.make_task(config).build_model(nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, 256, (batch, prompt), dtype=np.int32)
    decoder = Decoder(model, context=config.model.seq_len)
    cached = _best(lambda: decoder.generate(prompts.tolist(), new, temperature=0.0), repeats)
    plain = _best(lambda: _without_cache(model, prompts, new), repeats)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"name": name, "params": params, "cached_s": cached, "plain_s": plain,
            "compiles": decoder.compiles, "batch": batch, "prompt": prompt, "new": new}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--models", default="tiny_lm,lm_125m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    section = Section("decode")
    rows = []
    for name in args.models.split(","):
        r = measure(name, args.batch, args.prompt, args.new, args.repeats)
        tokens = r["batch"] * r["new"]
        speedup = r["plain_s"] / r["cached_s"]
        rows.append(
            f"| {name} | {r['params'] / 1e6:.1f}M | {tokens / r['cached_s']:,.0f} | "
            f"{tokens / r['plain_s']:,.0f} | **{speedup:.1f}×** | {r['compiles']} |"
        )
        section.claim(
            f"decode tokens/s with the KV cache, {name}, CPU", round(tokens / r["cached_s"]),
            unit="tokens/s", baseline=f"no cache {tokens / r['plain_s']:,.0f} tokens/s",
            headline=False, note=f"{speedup:.1f}× the forward pass without a cache",
            section="Decoding speed on CPU",
        )  # fmt: skip
        print(rows[-1], flush=True)
    lines = [
        "## Decoding speed on CPU: the KV cache against the forward pass without it",
        "",
        f"{section.header()} A batch of {args.batch} prompts of {args.prompt} tokens, "
        f"{args.new} new tokens each, greedy; best of {args.repeats} after one untimed run. "
        "Without the cache, the whole sequence (padded to its final length) goes through the "
        "model for every new token. Initialised weights (speed does not depend on them).",
        "",
        "| model | parameters | tokens/s with the cache | tokens/s without | speed-up | "
        "compiles (prefill + step) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    section.write(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
