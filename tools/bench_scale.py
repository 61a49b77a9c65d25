"""Scale: the syncer with M synthetic learners at 25M-1B parameters (issue 20).

  python -m tools.bench_scale --out=benchmarks/results/scale.md     # every section (`make bench`)
  python -m tools.bench_scale --section=syncer --sizes=125m,350m --learners=2,4,8 --rounds=3
  python -m tools.bench_scale --section=memory --sizes=125m,350m,1b   # compiled memory, 8 devices
  python -m tools.bench_scale --section=learner --sizes=125m          # a learner's stall and RSS
  python -m tools.bench_scale --section=learner --sizes=1b --step_s=1.5
  python -m tools.bench_scale --section=precision --steps=200         # bf16 vs float32, tiny_lm

Per (size, M): a syncer process started as an operator would (`python -m
decoupled_diloco.syncer --checkpoint_dir=...`: write-ahead log and Orbax snapshots on), 4
fragments, quorum M, and M learners in this process (one thread each, one real
`SyncerClient` each) that register, push every fragment's outer gradient (float32, no
compression) and pull every merged fragment, for `--rounds` rounds. Measured from outside: the
syncer's peak and current RSS (`/proc/PID/status` VmHWM, VmRSS) after each round, the bytes it
wrote to disk (`/proc/PID/io` write_bytes), the merge time it reports per fragment
(`merge_log[].merge_s`), and this machine's memcpy bandwidth in the same run (numpy copy of
256 MB, best of 5), and the bytes under its checkpoint directory. The model shapes are those
of `experiments/configs/lm_*.py`. A cell whose push store and snapshots would not fit on this
disk is skipped with a row that says so (`disk_shortfall`), not run until the disk fills.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from tools.benchkit import ROOT, Section, serving

TOKEN = "bench-scale"
CPU = {"JAX_PLATFORMS": "cpu"}
FRAGMENTS = 4
# The transformer shapes (byte vocabulary); 25m is the transport benchmark's tree.
SIZES = {
    "25m": {"d_model": 1024, "num_layers": 2, "num_heads": 8, "mlp_hidden": 2816},
    "125m": {"d_model": 768, "num_layers": 12, "num_heads": 12, "mlp_hidden": 3072},
    "350m": {"d_model": 1024, "num_layers": 24, "num_heads": 16, "mlp_hidden": 3584},
    "1b": {"d_model": 2048, "num_layers": 20, "num_heads": 16, "mlp_hidden": 5632},
}


def memcpy_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's memcpy bandwidth (GB/s of bytes copied), numpy, best of `repeats`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def proc_memory(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process, bytes."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def reset_peak(pid: int) -> None:
    """Resets a process's VmHWM to its current RSS (Linux `clear_refs` 5), where allowed."""
    try:
        pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def proc_written(pid: int) -> int:
    """Bytes a process caused to be written to storage (`/proc/PID/io` write_bytes)."""
    for line in pathlib.Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def config_for(size: str, learners: int, snapshots_kept: int = 3):
    """The decoupled experiment of one benchmark cell (`snapshots_kept`: the syncer's)."""
    from decoupled_diloco import config as c

    return c.replace(
        c.ExperimentConfig(mode="decoupled", num_learners=learners, inner_steps=100),
        **{"checkpoint.max_to_keep": snapshots_kept},
        **{f"model.{k}": v for k, v in SIZES[size].items()},
        **{
            "model.seq_len": 1024,
            "train_steps": 1_000_000,
            "data.batch_size": 8,
            "decoupled.fragments": FRAGMENTS,
            "decoupled.quorum": learners,
            "decoupled.syncer.rpc_timeout_s": 600.0,
            "decoupled.syncer.learner_timeout_s": 600.0,
            "decoupled.syncer.max_push_bytes": 4 << 30,
            "decoupled.syncer.stream_idle_s": 300.0,
        },
    )


def run_cell(size: str, learners: int, rounds: int, snapshots_kept: int = 3) -> dict:
    """One (size, M) cell: a syncer process and M pushing threads; the measurements."""
    from decoupled_diloco import tasks
    from decoupled_diloco.comm.client import SyncerClient
    from decoupled_diloco.core import fragments

    config = config_for(size, learners, snapshots_kept)
    task = tasks.make_task(config)
    specs = fragments.tensor_specs(task.abstract_params())
    cut = fragments.partition(specs, FRAGMENTS)
    owned = sum(s.nbytes for s in specs)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_scale_"))
    rows = []
    with serving(config, tmp, TOKEN, True, env=CPU, timeout_s=900, cleanup=True) as served:
        syncer, port = served.proc, served.port
        start_hwm, start_rss = proc_memory(syncer.pid)
        clients = [
            SyncerClient(f"127.0.0.1:{port}", config.decoupled.syncer, TOKEN)
            for _ in range(learners)
        ]
        clients[0].wait_ready(300)
        fp = task.fingerprint(specs)
        for i, client in enumerate(clients):
            client.register(i, fp)
        rng = np.random.default_rng(0)
        # One outer gradient per fragment, shared by every learner (the syncer's work does
        # not depend on the values); small next to the initial weights (std 0.02).
        deltas = [[(rng.standard_normal(s.shape) * 1e-4).astype(s.dtype) for s in f] for f in cut]
        tokens = config.inner_steps * config.data.batch_size * config.model.seq_len
        for r in range(rounds):
            written0 = proc_written(syncer.pid)
            reset_peak(syncer.pid)  # this round's peak, not start-up's
            errors: list[BaseException] = []

            def learner(i: int, r: int = r, errors: list = errors) -> None:
                try:
                    for p, frag in enumerate(cut):
                        reply = clients[i].push(
                            learner_id=i,
                            fragment=p,
                            round=r,
                            base_version=r,
                            steps=config.inner_steps,
                            tokens=tokens,
                            specs=frag,
                            arrays=deltas[p],
                        )
                        if not reply.accepted:
                            raise RuntimeError(f"push refused: {reply.reason}")
                except BaseException as error:  # noqa: BLE001 - reported below
                    errors.append(error)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=learner, args=(i,)) for i in range(learners)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            push_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for p in range(FRAGMENTS):
                version, _ = clients[0].pull(0, p, r + 1, 600.0)
                if version != r + 1:
                    raise RuntimeError(f"fragment {p} at version {version}, wanted {r + 1}")
            pull_s = time.perf_counter() - t0
            status = clients[0].status()
            merges = [m for m in status["merge_log"] if m["version"] == r + 1]
            hwm, rss = proc_memory(syncer.pid)
            rows.append(
                {
                    "round": r,
                    "push_s": push_s,
                    "pull_s": pull_s,
                    "merge_s": sum(m.get("merge_s", float("nan")) for m in merges),
                    "merged": [len(m["learners"]) for m in merges],
                    "written_mb": (proc_written(syncer.pid) - written0) / 1e6,
                    "disk_gb": _disk_bytes(tmp) / 1e9,
                    "hwm": hwm,
                    "rss": rss,
                }
            )
            print(f"  {size} M={learners} round {r}: {rows[-1]}", flush=True)
        for client in clients:
            client.close()
    return {
        "size": size,
        "learners": learners,
        "params": sum(int(np.prod(s.shape)) for s in specs),
        "bytes": owned,
        "start_hwm": start_hwm,
        "start_rss": start_rss,
        "rows": rows,
    }


def disk_shortfall(size: str, learners: int, rounds: int, snapshots_kept: int = 3) -> str:
    """Why a cell cannot run on this disk ("" if it can).

    A durable syncer keeps each push's file until the oldest kept snapshot is newer than its
    merge, and `snapshots_kept` snapshots of Θ and the momentum (one more while one is
    written): at most about the pushes of `snapshots_kept` + 1 rounds plus 2 models per
    snapshot (measured at 1B, M=4, 3 kept: 57.6 GB after 2 rounds, 14× the model).
    """
    from decoupled_diloco import tasks
    from decoupled_diloco.core import fragments

    task = tasks.make_task(config_for(size, learners))
    model = sum(s.nbytes for s in fragments.tensor_specs(task.abstract_params()))
    need = model * (learners * min(rounds, snapshots_kept + 1) + 2 * (snapshots_kept + 1))
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if need <= free:
        return ""
    return (
        f"skipped: needs ~{need / 1e9:.0f} GB of disk for its push store and snapshots, "
        f"{free / 1e9:.0f} GB free"
    )


def _disk_bytes(directory: pathlib.Path) -> int:
    """Bytes of the files under `directory` (the syncer's checkpoint directory and push store)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def table(cells: list[dict], memcpy: float) -> list[str]:
    """The markdown rows of every cell."""
    lines = [
        "| size (params) | M | round | push s | merge s (all fragments) | merge GB/s (M × bytes) "
        "| ÷ memcpy | written MB | on disk GB | started GB (peak) | round peak GB "
        "| peak ÷ model | RSS GB | RSS ÷ model |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        if cell.get("skipped"):
            lines.append(f"| {cell['size']} | {cell['learners']} | — | {cell['skipped']} |")
            continue
        model = cell["bytes"]
        for row in cell["rows"]:
            rate = cell["learners"] * model / row["merge_s"] / 1e9 if row["merge_s"] else 0.0
            lines.append(
                f"| {cell['size']} ({cell['params'] / 1e6:.1f}M) | {cell['learners']} | "
                f"{row['round']} | {row['push_s']:.1f} | {row['merge_s']:.2f} | {rate:.2f} | "
                f"{rate / memcpy:.2f} | {row['written_mb']:.0f} | {row['disk_gb']:.1f} | "
                f"{cell['start_rss'] / 1e9:.2f} "
                f"({cell['start_hwm'] / 1e9:.2f}) | {row['hwm'] / 1e9:.2f} | "
                f"{row['hwm'] / model:.1f} | {row['rss'] / 1e9:.2f} | {row['rss'] / model:.1f} |"
            )
    return lines


def compiled_memory(sizes: list[str], devices: int = 8) -> list[str]:
    """Per-device bytes of the compiled inner step, FSDP over 8 devices vs replicated."""
    import jax
    import numpy as np

    from decoupled_diloco import config as c
    from decoupled_diloco import planning
    from decoupled_diloco.island import Island

    lines = [
        f"| size (params) | mesh | params + optimizer GB / device | ÷ (total / {devices}) "
        "| temporaries GB / device | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for size in sizes:
        for fsdp in (False, True):
            config = c.replace(
                config_for(size, 2),
                **{"mesh.fsdp": fsdp, "model.dtype": "bfloat16", "data.batch_size": devices},
            )
            island = Island(config, jax.devices()[:devices], mesh_shape=(devices, 1))
            batch = jax.ShapeDtypeStruct((devices, config.model.seq_len + 1), np.int32)
            t0 = time.perf_counter()
            memory = planning.plan(island, batch)
            took = time.perf_counter() - t0
            state = island.abstract_state
            total = sum(
                int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                for x in jax.tree.leaves((state.params, state.opt_state))
            )
            params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
            mine = memory.params + memory.opt_state
            lines.append(
                f"| {size} ({params / 1e6:.0f}M) | {devices}x1{' fsdp' if fsdp else ''} | "
                f"{mine / 1e9:.3f} | {mine / (total / devices):.2f} | {memory.temp / 1e9:.3f} | "
                f"{took:.0f} |"
            )
            print(lines[-1], flush=True)
    return lines


def learner_child(
    size: str, address: str, steps: int, step_s: float, keep_overlap: bool = True
) -> None:
    """A learner with synthetic steps (`DecoupledSync` in a plain loop); prints one JSON line.

    Each step touches every parameter once (a jitted elementwise update, as a real step
    writes them) and then waits out `step_s`; the time spent in the two sync calls is the
    learner's stall.
    """
    import json

    import jax
    import jax.numpy as jnp

    import decoupled_diloco as dd
    from decoupled_diloco import tasks

    config = config_for(size, 1)
    config = dd.replace(
        config,
        **{"decoupled.quorum": 1, "train_steps": steps, "decoupled.keep_overlap": keep_overlap},
    )
    task = tasks.make_task(config)
    _, process = proc_memory(os.getpid())  # the process before the model (JAX, gRPC, Python)
    params = task.init_params(config.seed)
    model = sum(x.nbytes for x in jax.tree.leaves(params))
    touch = jax.jit(
        lambda p: jax.tree.map(lambda x: x * jnp.float32(1.0 - 1e-7), p), donate_argnums=0
    )
    tokens = config.data.batch_size * config.model.seq_len
    stall = {"apply": 0.0, "push": 0.0, "max": 0.0}
    t_run = time.perf_counter()
    with dd.DecoupledSync(config, learner_id=0, syncer=address, params=params, task=task) as sync:
        t_join = time.perf_counter() - t_run
        join_hwm, _ = proc_memory(os.getpid())
        reset_peak(os.getpid())  # the loop's own peak from here (start-up's is join_hwm)
        t_run = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            params = sync.apply_arrivals(params)
            took = time.perf_counter() - t0
            stall["apply"] += took
            t_step = time.perf_counter()
            params = jax.block_until_ready(touch(params))
            time.sleep(max(step_s - (time.perf_counter() - t_step), 0.0))
            t0 = time.perf_counter()
            sync.step_done(params, tokens=tokens, loss=jnp.float32(1.0))
            stall["push"] += time.perf_counter() - t0
            stall["max"] = max(stall["max"], took, time.perf_counter() - t0)
        versions = list(sync.versions)
        wall = time.perf_counter() - t_run  # the loop's (joining and the final flush apart)
        hwm, _ = proc_memory(os.getpid())  # the loop's peak (the final flush apart)
    flush_hwm, rss = proc_memory(os.getpid())  # (with the final flush: every fragment at once)
    print(
        "RESULT "
        + json.dumps(
            {"model": model, "hwm": hwm, "rss": rss, "stall": stall, "wall": wall,
             "join_s": t_join, "join_hwm": join_hwm, "versions": versions,
             "process": process, "flush_hwm": flush_hwm}
        ),
        flush=True,
    )  # fmt: skip


def learner_cells(
    sizes: list[str], steps: int, step_s: float, keep_overlap: bool = True
) -> list[str]:
    """Per size: a syncer process and one synthetic learner process; the learner's numbers.

    `keep_overlap`: the learners' `decoupled.keep_overlap` (a copy of each fragment at its push,
    host memory on CPU, kept until its merge is applied).
    """
    import json

    lines = [
        "| size (params) | steps × step s | merges applied | stall % of wall | of it: "
        "applying merges / pushing s | longest stall s | join s | start-up peak GB | loop "
        "peak RSS GB | loop peak ÷ model | process before the model GB | loop peak less it ÷ "
        "model | with the final flush GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        config = config_for(size, 1)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_scale_learner_"))
        env = {**os.environ, "DD_RUN_TOKEN": TOKEN, **CPU}
        with serving(config, tmp, TOKEN, env=CPU, timeout_s=900, cleanup=True) as served:
            child = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tools.bench_scale",
                    "--section=learner_child",
                    f"--sizes={size}",
                    f"--address={served.address}",
                    f"--steps={steps}",
                    f"--step_s={step_s}",
                    f"--keep_overlap={keep_overlap}",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=3600,
                check=True,
            )
        line = next(x for x in child.stdout.splitlines() if x.startswith("RESULT "))
        r = json.loads(line[len("RESULT ") :])
        pushes, st = sum(r["versions"]), r["stall"]
        lines.append(
            f"| {size} ({r['model'] / 4e6:.0f}M) | {steps} × {step_s} | {pushes} | "
            f"{100 * (st['apply'] + st['push']) / r['wall']:.2f} | "
            f"{st['apply']:.2f} / {st['push']:.2f} | {st['max']:.3f} | {r['join_s']:.1f} | "
            f"{r['join_hwm'] / 1e9:.2f} | {r['hwm'] / 1e9:.2f} | "
            f"{r['hwm'] / r['model']:.2f} | {r['process'] / 1e9:.2f} | "
            f"{(r['hwm'] - r['process']) / r['model']:.2f} | {r['flush_hwm'] / 1e9:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines


def precision(steps: int) -> list[str]:
    """tiny_lm trained in float32 and in bfloat16 compute (float32 parameters): the losses."""
    import tempfile as tf

    import decoupled_diloco as dd
    from decoupled_diloco import config as c

    lines = ["| compute dtype | final train loss | final eval loss | wall s |", "|---|---|---|---|"]
    results = {}
    for dtype in ("float32", "bfloat16"):
        base = c.ExperimentConfig(
            mode="dp",
            num_learners=1,
            train_steps=steps,
            inner_steps=50,
            model=c.ModelConfig(
                vocab_size=256, d_model=128, num_layers=2, num_heads=4, mlp_hidden=512, seq_len=128
            ),
            data=c.DataConfig(batch_size=16),
            optim=c.OptimConfig(lr=3e-3),
            eval=c.EvalConfig(every=steps, batches=8),
        )
        config = c.replace(base, **{"model.dtype": dtype})
        summary = dd.train_and_evaluate(config, tf.mkdtemp(prefix="bench_precision_")).summary
        results[dtype] = summary
        lines.append(
            f"| {dtype} | {summary['final_train_loss']:.4f} | {summary['final_eval_loss']:.4f} | "
            f"{summary['wall_s']:.0f} |"
        )
    a, b = (results[d]["final_eval_loss"] for d in ("float32", "bfloat16"))
    lines += ["", f"bfloat16 / float32 final eval loss: {b / a:.4f} (target: within 1%)."]
    return lines


def _write(out: str, title: str, text: str, lines: list[str]) -> None:
    """Prints a part of the section and appends it to `out` (if given)."""
    Section("scale").append(out, "\n".join([title, "", text, "", *lines, ""]))


def _claims(section: Section, cells: list[dict], memcpy: float) -> None:
    """The syncer's round peak over the model's bytes at the largest size, and merge speed."""
    done = [c for c in cells if not c.get("skipped")]
    if not done:
        return
    largest = max(done, key=lambda c: c["bytes"])
    at_size = [c for c in done if c["size"] == largest["size"]]
    peak = max(r["hwm"] / c["bytes"] for c in at_size for r in c["rows"])
    ms = ", ".join(str(c["learners"]) for c in at_size)
    section.claim(
        f"syncer round peak ÷ model bytes at {largest['size']}, M = {ms}",
        round(peak, 1),
        unit="×",
        goal="≤ 4×",
        met=peak <= 4.0,
        headline=True,
        section="Syncer at scale",
    )
    rates = [
        c["learners"] * c["bytes"] / r["merge_s"] / 1e9 / memcpy
        for c in done
        for r in c["rows"]
        if r["merge_s"]
    ]
    if rates:
        section.claim(
            "syncer merge throughput ÷ memcpy (slowest round)",
            round(min(rates), 2),
            unit="× memcpy",
            goal="≥ 0.3",
            met=min(rates) >= 0.3,
            section="Syncer at scale",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--sizes", default="25m,125m,350m,1b")
    parser.add_argument("--learners", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--snapshots_kept", type=int, default=3,
        help="syncer: snapshots kept (checkpoint.max_to_keep; fewer: less disk held by pushes)",
    )  # fmt: skip
    parser.add_argument("--label", default="", help="A heading for this run (e.g. before).")
    parser.add_argument(
        "--section", default="all", help="all | syncer | memory | learner | precision"
    )
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step_s", type=float, default=0.5)
    parser.add_argument(
        "--keep_overlap",
        type=lambda v: v.lower() in ("1", "true", "yes"),
        default=True,
        help="learner section: the learner's decoupled.keep_overlap (True|False)",
    )
    args = parser.parse_args()
    # A stopped benchmark still removes its syncer and its temporary directories (`finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.section == "all":  # each in its own process (`memory` fakes 8 devices first)
        if args.out:
            pathlib.Path(args.out).write_text("")
        for section, extra in (
            ("syncer", [f"--sizes={args.sizes}", f"--learners={args.learners}"]),
            ("memory", ["--sizes=125m,350m,1b"]),
            ("learner", ["--sizes=125m", "--steps=200", "--step_s=0.5"]),
            # (1B: a synthetic step rewrites 4 GB, ~0.5-1 s on 2 cores; the learner peaks at
            # ~11 GB beside a ~10 GB syncer, measured.)
            ("learner", ["--sizes=1b", "--steps=200", "--step_s=1.5"]),
            # (Without the overlap copy the learner holds θ, the anchor and one fragment in
            # flight: issue 20's bound, 2.29x net of the process, measured.)
            ("learner", ["--sizes=1b", "--steps=200", "--step_s=1.5", "--keep_overlap=False"]),
            ("precision", ["--steps=200"]),
        ):
            command = [sys.executable, "-m", "tools.bench_scale", f"--section={section}", *extra]
            subprocess.run(command + ([f"--out={args.out}"] if args.out else []), check=True)
        return
    if args.section == "precision":
        _write(
            args.out,
            "### Mixed precision: bfloat16 compute against float32 (tiny_lm)",
            f"Command: `python -m tools.bench_scale --section=precision --steps={args.steps}` "
            f"(run {datetime.datetime.now():%Y-%m-%d %H:%M}); the tiny_lm model (0.5M "
            f"parameters), one learner (`dp`), {args.steps} steps, same seed and data; "
            "parameters and optimizer state float32 in both, loss in float32.",
            precision(args.steps),
        )
        return
    if args.section == "learner_child":
        learner_child(args.sizes, args.address, args.steps, args.step_s, args.keep_overlap)
        return
    if args.section == "learner":
        lines = learner_cells(args.sizes.split(","), args.steps, args.step_s, args.keep_overlap)
        command = (
            f"python -m tools.bench_scale --section=learner --sizes={args.sizes} "
            f"--steps={args.steps} --step_s={args.step_s}"
            + ("" if args.keep_overlap else " --keep_overlap=False")
        )
        _write(
            args.out,
            "### A learner pushing a large model: stall and host memory",
            f"Command: `{command}` (run {datetime.datetime.now():%Y-%m-%d %H:%M}); one learner "
            "process with synthetic steps (`DecoupledSync` in a plain loop: each step rewrites "
            "every parameter, then waits out the step time), H = 100, 4 fragments, a syncer "
            "process without checkpoints, quorum 1, float32 pushes. Stall: time inside "
            "`apply_arrivals` and `step_done`. On CPU the parameters themselves are host memory. "
            "Loop peak: VmHWM from the end of the join to the end of the loop (the final flush, "
            "which pushes every fragment at once, apart: its own column); 'process before the "
            "model': RSS once JAX and the client are loaded, before the parameters exist.",
            lines,
        )
        return
    if args.section == "memory":
        from decoupled_diloco.runtime import configure_cpu_devices

        configure_cpu_devices(8)
        lines = compiled_memory(args.sizes.split(","))
        command = f"python -m tools.bench_scale --section=memory --sizes={args.sizes}"
        _write(
            args.out,
            "### Compiled memory per device: FSDP over 8 devices vs replicated",
            f"Command: `{command}` (run {datetime.datetime.now():%Y-%m-%d %H:%M}); 8 fake "
            "CPU devices, mesh (8, 1), bf16 compute, AdamW, batch 8 x 1024 tokens; "
            "parameter and optimizer bytes from the shardings, temporaries from the "
            "compiled step's `memory_analysis()` (`decoupled_diloco.planning`).",
            lines,
        )
        return
    memcpy = memcpy_gbs()
    print(f"memcpy {memcpy:.1f} GB/s", flush=True)
    cells = []
    for size in args.sizes.split(","):
        for m in (int(x) for x in args.learners.split(",")):
            skip = disk_shortfall(size, m, args.rounds, args.snapshots_kept)
            cells.append({"size": size, "learners": m, "skipped": skip} if skip else None)
            cells[-1] = cells[-1] or run_cell(size, m, args.rounds, args.snapshots_kept)
    command = (
        f"python -m tools.bench_scale --section=syncer --sizes={args.sizes} "
        f"--learners={args.learners} --rounds={args.rounds}"
        + (f" --snapshots_kept={args.snapshots_kept}" if args.snapshots_kept != 3 else "")
        + (f" --out={args.out}" if args.out else "")
    )
    section = Section("scale")
    _claims(section, cells, memcpy)
    text = "\n".join(
        [
            f"### Syncer at scale{': ' + args.label if args.label else ''}",
            "",
            f"Command: `{command}` (run {datetime.datetime.now():%Y-%m-%d %H:%M}); memcpy "
            f"{memcpy:.1f} GB/s in the same run. Syncer process with a checkpoint directory "
            f"(WAL + snapshots), {FRAGMENTS} fragments, quorum M, float32 pushes. 'started': "
            "the syncer's RSS once serving, and its peak while starting (VmHWM then); 'peak': "
            "its VmHWM during the round (reset when the round starts); 'RSS': after the round.",
            "",
            *table(cells, memcpy),
            "",
        ]
    )
    section.append(args.out, text)


if __name__ == "__main__":
    main()
