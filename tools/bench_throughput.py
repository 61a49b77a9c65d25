"""Inner-step throughput: the framework's step against a bare hand-written `jax.jit` step.

  python -m tools.bench_throughput --out=benchmarks/results/throughput.md

Both run the `tiny_lm` model on the same devices in the same process, on the same batches,
measured in alternating windows so that machine noise hits both alike. The framework side is
what a learner really runs per step: the grain iterator, the host-to-device batch transfer and
`Island.step`. The bare side is the textbook loop: `nnx.split`, one `jax.jit` of
value_and_grad + optax update with donation, fed pre-built numpy batches.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.data import text as data  # noqa: E402
from decoupled_diloco.island import Island  # noqa: E402
from decoupled_diloco.models.transformer import Transformer, lm_loss  # noqa: E402
from decoupled_diloco.optim import make_inner_optimizer  # noqa: E402
from decoupled_diloco.tasks import model_config  # noqa: E402
from tools.benchkit import Section  # noqa: E402

WINDOW, WINDOWS, WARMUP = 20, 6, 3


def _bare_step(config: config_lib.ExperimentConfig):
    model = Transformer(model_config(config), nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_inner_optimizer(config)
    opt_state = tx.init(params)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(graphdef, p, tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state


def _time_window(run_one, steps: int) -> float:
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = run_one()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def measure(mesh_shape: tuple[int, int]) -> dict[str, float]:
    """Seconds per step (median over windows) of the framework step and the bare step."""
    config = config_lib.replace(
        config_lib.ExperimentConfig(), num_learners=1, **{"mesh.shape": mesh_shape}
    )
    corpus = data.load_corpus()
    devices = jax.devices()[: mesh_shape[0] * mesh_shape[1]]
    island = Island(config, devices)
    it = data.train_iterator(corpus.train_BN, 128, config.data.batch_size, 0, 1, config.seed)
    fw = {"state": island.init(config.seed)}

    def framework_step():
        fw["state"], loss = island.step(fw["state"], next(it))
        return loss

    batches = [next(it) for _ in range(64)]
    auto = (jax.sharding.AxisType.Auto,) * 2
    one_device = jax.make_mesh((1, 1), ("data", "model"), axis_types=auto, devices=devices[:1])
    with jax.set_mesh(one_device):  # the model's sharding annotations need a mesh to resolve
        bare_fn, params, opt_state = _bare_step(config)
    bare = {"params": params, "opt": opt_state, "i": 0}

    def bare_step():
        tokens = jax.device_put(batches[bare["i"] % len(batches)], devices[0])
        bare["i"] += 1
        bare["params"], bare["opt"], loss = bare_fn(bare["params"], bare["opt"], tokens)
        return loss

    if mesh_shape != (1, 1):
        bare_step = None  # the bare loop is single-device by construction
    _time_window(framework_step, WARMUP)
    if bare_step:
        _time_window(bare_step, WARMUP)
    fw_times, bare_times = [], []
    for _ in range(WINDOWS):
        fw_times.append(_time_window(framework_step, WINDOW))
        if bare_step:
            bare_times.append(_time_window(bare_step, WINDOW))
    result = {"framework_s": statistics.median(fw_times), "trace_count": island.trace_count}
    if bare_times:
        result["bare_s"] = statistics.median(bare_times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/throughput.md")
    args = parser.parse_args()
    tokens_per_step = 16 * 128
    single = measure((1, 1))
    double = measure((2, 1))
    ratio = single["bare_s"] / single["framework_s"]
    best_s = min(single["framework_s"], double["framework_s"])
    section = Section("throughput")
    section.claim(
        "framework / bare jax.jit throughput, mesh 1x1",
        round(ratio, 3),
        unit="×",
        baseline=f"bare jax.jit {1e3 * single['bare_s']:.1f} ms/step "
        f"({tokens_per_step / single['bare_s']:,.0f} tokens/s)",
        goal=">= 0.97",
        met=ratio >= 0.97,
        headline=True,
        section="Inner-step throughput (foundation issue)",
    )
    section.claim(
        "best single-learner rate",
        round(tokens_per_step / best_s),
        unit="tokens/s",
        goal=">= 20,000",
        met=tokens_per_step / best_s >= 20_000,
        section="Inner-step throughput (foundation issue)",
    )
    lines = [
        "## Inner-step throughput (foundation issue)",
        "",
        f"{section.header()} "
        f"tiny_lm (d128, 2 layers, MLP 512, seq 128, batch 16), one learner; median of "
        f"{WINDOWS} windows of {WINDOW} steps, framework and bare windows alternating.",
        "",
        "| setup | ms/step | tokens/s |",
        "|---|---|---|",
        f"| bare `jax.jit` step, 1 device | {1e3 * single['bare_s']:.1f} | "
        f"{tokens_per_step / single['bare_s']:,.0f} |",
        f"| framework step (grain + transfer + `Island.step`), mesh 1x1 | "
        f"{1e3 * single['framework_s']:.1f} | {tokens_per_step / single['framework_s']:,.0f} |",
        f"| framework step, mesh 2x1 (2 fake CPU devices) | {1e3 * double['framework_s']:.1f} | "
        f"{tokens_per_step / double['framework_s']:,.0f} |",
        "",
        f"- Framework / bare throughput ratio (mesh 1x1): **{ratio:.3f}** (target >= 0.97).",
        f"- Best single-learner rate: **{tokens_per_step / best_s:,.0f} tokens/s** "
        "(target >= 20,000).",
        f"- Inner step traces: {single['trace_count']} (1x1), {double['trace_count']} (2x1).",
        "",
    ]
    section.write(args.out, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
