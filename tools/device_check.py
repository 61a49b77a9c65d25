"""The accelerator check (issue 20): inner-step speed and MFU, and a short decoupled run.

  bash tools/device_check.sh                      # on a GPU machine: lm_125m and lm_1b, bf16
  python -m tools.device_check --sizes=tiny --out=/tmp/gpu.md   # anywhere (the CPU test)

1. Inner step of each size in bfloat16 on one device: tokens/s of the framework's step
   (`Island.step`, the learners' own) and of a bare `jax.jit` step of the same model, loss and
   optimizer (nothing but value_and_grad and the optax update); their ratio; and the MFU,
   model FLOPs (6·N per token plus attention, 12·L·T·d) per second over the device's dense
   bf16 peak (known devices only).
2. A decoupled run of 2 learners of the first size (`experiments.train`, learners on the
   accelerator, the syncer on the host CPU): goodput, stall, merges, final loss.

Writes a markdown section (`--out`) with the command, the device and every number it saw.
Everything comes from the checkout and pip; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Dense bf16 peak FLOP/s by device kind (vendor data sheets; sparse figures are twice these).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "B200": 2250e12}
SIZES = {  # size -> (config file, its argument)
    "tiny": ("experiments/configs/tiny_lm.py", None),
    "125m": ("experiments/configs/lm.py", "125m"),
    "1b": ("experiments/configs/lm.py", "1b"),
}


def _config(size: str, batch_size: int, seq_len: int):
    """The size's config in bfloat16; `size` may name an attention ("1b:xla", `model.attention`)."""
    import importlib.util

    from decoupled_diloco import config as c

    size, _, attention = size.partition(":")
    path, argument = SIZES[size]
    spec = importlib.util.spec_from_file_location("size_config", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = c.from_config_dict(module.get_config(*([argument] if argument else [])))
    overrides = {"model.dtype": "bfloat16", "data.batch_size": batch_size}
    if attention:
        overrides["model.attention"] = attention
    if seq_len:
        overrides["model.seq_len"] = seq_len
    return c.replace(config, **overrides)


def model_flops_per_token(config, params: int) -> float:
    """Training FLOPs per token: 6·N for the weights, plus attention scores (12·L·T·d)."""
    m = config.model
    return 6.0 * params + 12.0 * m.num_layers * m.seq_len * m.d_model


def step_speed(size: str, batch_size: int, seq_len: int, steps: int) -> dict:
    """Tokens/s of the framework's inner step and of a bare jitted step, one device."""
    import jax
    import numpy as np
    import optax

    from decoupled_diloco.island import Island

    config = _config(size, batch_size, seq_len)
    device = jax.devices()[0]
    island = Island(config, [device], mesh_shape=(1, 1))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, (batch_size, config.model.seq_len + 1)).astype(np.int32)
    tokens = batch_size * config.model.seq_len

    def timed(step, state):
        state, loss = step(state)  # compile
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss = step(state)
        jax.block_until_ready(loss)
        return steps * tokens / (time.perf_counter() - t0), float(loss), state

    placed = island.put_batch(batch)
    state = island.init(0)
    params = sum(int(x.size) for x in jax.tree.leaves(state.params))
    framework, loss_f, state = timed(lambda s: island.step(s, placed), state)
    del state
    # The bare step: the same model, loss and optimizer, nothing else.
    task, tx = island.task, island.tx
    fresh = island.init(0)
    graphdef = island.graphdef

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # as the framework's step donates
    def bare(params, opt_state, tokens_BT1):
        def loss_of(p):
            return task.train_loss(graphdef, p, fresh.local, tokens_BT1)[0]

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def bare_step(s):
        p, o, loss = bare(s[0], s[1], placed)
        return (p, o), loss

    bare_rate, loss_b, _ = timed(bare_step, (fresh.params, fresh.opt_state))
    flops = model_flops_per_token(config, params)
    kind = device.device_kind
    peak = next((v for k, v in PEAK_BF16.items() if k in kind), 0.0)
    from decoupled_diloco.models.transformer import attention_implementation

    return {
        "size": size,
        "attention": attention_implementation(config.model.attention, config.model.dtype),
        "params": params,
        "device": kind,
        "batch": batch_size,
        "seq_len": config.model.seq_len,
        "framework_tokens_s": framework,
        "bare_tokens_s": bare_rate,
        "ratio": framework / bare_rate,
        "mfu": framework * flops / peak if peak else float("nan"),
        "losses": (loss_f, loss_b),
    }


def decoupled_run(
    size: str, batch_size: int, seq_len: int, steps: int, timeout_s: float = 300.0
) -> dict:
    """A short decoupled run of 2 learners (`experiments.train`); its summary's numbers."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="device_check_"))
    path, argument = SIZES[size.partition(":")[0]]
    flags = [
        f"--config={path}" + (f":{argument}" if argument else ""),
        f"--workdir={workdir}",
        "--config.mode=decoupled",
        "--config.model.dtype=bfloat16",
        f"--config.data.batch_size={batch_size}",
        f"--config.train_steps={steps}",
        f"--config.inner_steps={max(steps // 4, 4)}",  # at least the 4 fragments
        "--config.checkpoint.every=0",
        f"--config.eval.every={steps}",
        "--config.eval.batches=2",
    ]
    if seq_len:
        flags.append(f"--config.model.seq_len={seq_len}")
    if size.partition(":")[2]:
        flags.append(f"--config.model.attention={size.partition(':')[2]}")
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "experiments.train", *flags], cwd=ROOT, check=True, timeout=timeout_s
    )
    summary = json.loads((workdir / "summary.json").read_text())
    keep = ("goodput", "stall_fraction_max", "final_train_loss", "final_eval_loss", "tokens")
    out = {k: summary[k] for k in keep if k in summary}
    out["merges"] = len(summary.get("merge_log", []))
    out["merge_s_mean"] = sum(m.get("merge_s", 0.0) for m in summary.get("merge_log", [])) / max(
        out["merges"], 1
    )
    out["process_wall_s"] = time.perf_counter() - t0
    return out


def _versions() -> str:
    """The versions this check ran with (the accelerator's image may differ from our pins)."""
    import importlib.metadata as md

    names = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grpcio", "protobuf")
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found) + f", Python {sys.version.split()[0]}"


def _attempt(part: str, fn, *args) -> tuple[dict | None, str]:
    """Runs one part of the check: (its result, "") or (None, the error's last line)."""
    t0 = time.perf_counter()
    try:
        out = fn(*args)
        print(f"[device_check] {part}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        return out, ""
    except Exception as error:  # noqa: BLE001 (a part that fails is a row of the table)
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        print(f"[device_check] {part}: failed after {time.perf_counter() - t0:.0f} s", flush=True)
        return None, message


def _section(command: str, device: str, rows: list, run, run_error: str, args) -> str:
    """The markdown section: the command, the versions, each size's row, the decoupled run."""
    lines = [
        f"## Device check ({device})",
        "",
        f"Command: `{command}` (run {datetime.datetime.now():%Y-%m-%d %H:%M}), bfloat16 "
        "compute, float32 parameters and optimizer state, one device per learner. "
        f"Versions: {_versions()}.",
        "",
        "| size | attention | params | batch × seq | framework tokens/s | bare jit tokens/s "
        "| ratio | MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, r, error in rows:
        if r is None:
            lines.append(f"| {size} | | failed: {error} | | | | | |")
            continue
        lines.append(
            f"| {r['size'].partition(':')[0]} | {r['attention']} | {r['params'] / 1e6:.1f}M | "
            f"{r['batch']} × {r['seq_len']} | "
            f"{r['framework_tokens_s']:.0f} | {r['bare_tokens_s']:.0f} | {r['ratio']:.3f} | "
            f"{r['mfu']:.1%} |"
        )
    if args.run_steps:
        head = (
            f"Decoupled run, 2 learners of {args.run_size or args.sizes.split(',')[0]}, "
            f"{args.run_steps} steps "
            "(syncer on the host CPU): "
        )
        if run is not None:
            body = ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items()
            )
        else:
            body = f"failed: {run_error}" if run_error else "not reached"
        lines += ["", head + body]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="125m,1b")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=0, help="0: the config's")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (0: none)")
    parser.add_argument(
        "--run_steps", type=int, default=40, help="of the decoupled run (0: no decoupled run)"
    )
    parser.add_argument("--run_size", default="", help="of the decoupled run (default: the first)")
    parser.add_argument("--run_timeout_s", type=float, default=300.0)
    parser.add_argument(
        "--out", default="", help="append the section here (rewritten as each part ends)"
    )
    args = parser.parse_args()
    import jax

    device = jax.devices()[0].device_kind
    print(f"[device_check] devices {jax.devices()}; {_versions()}", flush=True)
    command = (
        f"python -m tools.device_check --sizes={args.sizes} --batch_size={args.batch_size} "
        f"--steps={args.steps} --run_steps={args.run_steps}"
        + (f" --run_size={args.run_size}" if args.run_size else "")
        + (f" --seq_len={args.seq_len}" if args.seq_len else "")
    )
    path = pathlib.Path(args.out) if args.out else None
    old = path.read_text() if path is not None and path.exists() else ""
    rows: list = []
    run, run_error = None, ""

    def write() -> str:  # after every part: a check cut short keeps what it measured
        section = _section(command, device, rows, run, run_error, args)
        if path is not None:
            path.write_text(old + ("\n" if old else "") + section)
        return section

    for size in args.sizes.split(",") if args.steps else ():  # --steps=0: the run alone
        r, error = _attempt(
            f"step {size}", step_speed, size, args.batch_size, args.seq_len, args.steps
        )
        rows.append((size, r, error))
        write()
    if args.run_steps:
        size = args.run_size or args.sizes.split(",")[0]
        run, run_error = _attempt(
            "decoupled run",
            decoupled_run,
            size,
            args.batch_size,
            args.seq_len,
            args.run_steps,
            args.run_timeout_s,
        )
    print(write())
    if any(r is None for _, r, _ in rows) or (args.run_steps and run is None):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
