r"""Restart cost of a decoupled learner: kill -9, start the same command, time to its first step.

  python -m tools.bench_restart --out=benchmarks/results/restart.md [--kills=5] [--standby]

Runs a syncer (with durable state) and one learner of `tiny_lm_decoupled` with checkpoints
every 20 steps, on the persistent compilation cache. After a cold start, it kills the learner
with SIGKILL and starts the very same command again, `--kills` times, each once the previous
incarnation has stepped 30 more steps. Every learner prints when its first step ends and where
the time went since the process started (`learner.recovery.startup_line`); the table is those
lines. The issue's torchft comparison target is <= 4 s from restart to stepping again.

`--standby` measures a second table the same way, restarting by activating a warm standby
(`decoupled_diloco.learner.standby`) instead of starting a new process: before each kill a spare has
warmed up (as a hot spare host has by the time a machine fails), and the time counts from its
activation.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time

from tools.benchkit import ROOT

_LINE = re.compile(r"first step ([\d.]+) s after ([^:]*): (.*)")


def _config():
    from decoupled_diloco import config as config_lib
    from experiments.configs import tiny_lm_decoupled
    from tools.decoupled_variants import TINY_DECOUPLED_BEFORE_GATHER

    base = config_lib.from_config_dict(tiny_lm_decoupled.get_config())
    return config_lib.replace(
        base,
        num_learners=1,
        train_steps=1_000_000,
        log_every=1000,
        **{"checkpoint.every": 20, **TINY_DECOUPLED_BEFORE_GATHER},  # as measured
    )


def measure(kills: int, workdir: pathlib.Path, standby: bool) -> list[tuple[str, float, str]]:
    """(label, seconds to first step, phase breakdown) of the cold start and each restart.

    With `standby`, each restart activates a warm spare (started and warmed up before the kill).
    """
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.learner.standby import Spares
    from decoupled_diloco.local import commands
    from decoupled_diloco.local.procs import Processes, free_port

    config = _config()
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = config_lib.write_config_file(config, workdir / "config.py")
    env = commands.child_env("bench-restart-token")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
    procs = Processes(workdir / "logs", env)
    port = free_port()
    journal = workdir / "checkpoints" / "learner_0.progress"
    command = commands.learner_command(
        config_file, f"127.0.0.1:{port}", 0, workdir / "learner_0.json"
    )

    def position() -> int:
        text = journal.read_text().strip() if journal.exists() else ""
        return int(text) if text.isdigit() else 0

    def wait(predicate, what: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}:\n{procs.tail('learner_0')}")
            if procs.failed():
                raise RuntimeError(f"a process failed:\n{procs.tail('learner_0')}")
            time.sleep(0.05)

    rows = []
    spares = Spares(procs, workdir / "standby", config_file, [(1, 1)], 1) if standby else None
    try:
        procs.start(
            "syncer",
            commands.syncer_command(
                config_file, workdir / "syncer.port", port, 0, workdir / "checkpoints" / "syncer_0"
            ),
        )
        for k in range(kills + 1):
            if k == 0 or spares is None:
                procs.start("learner_0", command)
            else:
                spares.activate("learner_0", command, [0], {})
            wait(
                lambda k=k: len(_LINE.findall(procs.tail("learner_0", 10_000))) > k,
                "the learner's first step",
            )
            start = position()
            wait(lambda start=start: position() >= start + 30, "30 more steps")
            seconds, _, phases = _LINE.findall(procs.tail("learner_0", 10_000))[-1]
            rows.append(("cold start" if k == 0 else f"restart {k}", float(seconds), phases))
            if k < kills and spares is not None:  # a warm spare is ready before the failure
                spare = spares.start((1, 1))
                wait(lambda spare=spare: spare.ready, "a warm standby")
            if k < kills:
                procs.procs["learner_0"].send_signal(signal.SIGKILL)
                procs.procs["learner_0"].wait()
    finally:
        procs.reap()
    return rows


def _table(title: str, origin: str, rows: list[tuple[str, float, str]]) -> list[str]:
    restarts = [s for label, s, _ in rows if label != "cold start"]
    return [
        f"### {title}",
        "",
        f"Seconds from {origin} to the end of its first step, and where they went:",
        "",
        "| run | to first step (s) | phases |",
        "|---|---|---|",
        *(f"| {label} | {seconds:.2f} | {phases} |" for label, seconds, phases in rows),
        "",
        f"Median over {len(restarts)} restarts: **{statistics.median(restarts):.2f} s** "
        "(target from the torchft comparison: <= 4 s).",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/restart.md")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument(
        "--standby", action="store_true", help="also restart from warm standby spares"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_restart_") as tmp:
        load_before = os.getloadavg()[0]
        fresh = measure(args.kills, pathlib.Path(tmp) / "fresh", standby=False)
        warm = measure(args.kills, pathlib.Path(tmp) / "warm", True) if args.standby else None
        load_after = os.getloadavg()[0]
    flag = " --standby" if args.standby else ""
    lines = [
        "## Restart cost of a killed learner",
        "",
        f"`python -m tools.bench_restart --out={args.out} --kills={args.kills}{flag}` "
        f"({time.strftime('%Y-%m-%d')}; load average {load_before:.1f} before, "
        f"{load_after:.1f} after, on {os.cpu_count()} cores). One `tiny_lm_decoupled` learner "
        "and a durable syncer; SIGKILL, then a restart at once.",
        "",
        *_table("New process (the same command again)", "the new process's start", fresh),
    ]
    if warm is not None:
        lines += _table(
            "Warm standby (a spare, warmed up before the kill, activated as the learner)",
            "the spare's activation",
            warm,
        )
    pathlib.Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
