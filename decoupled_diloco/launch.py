"""`mode=decoupled` on one machine: a syncer and M learner processes on 127.0.0.1.

The launcher runs exactly the commands a user would run by hand on separate hosts
(`python -m decoupled_diloco.syncer ...`, `python -m decoupled_diloco.learner ...`), with the
resolved config written to `workdir/config.py`, a random run token passed in the environment
(never on a command line), and each process's output in `workdir/logs/`. It polls the syncer's
status for one combined progress view and `metrics.jsonl`, evaluates the syncer's global
parameters at the end, and writes `summary.json`. Whatever happens (an error, Ctrl+C, SIGTERM),
every child is terminated and reaped before it returns; children also die with it if it is
killed outright (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.metrics import MetricsWriter, write_summary

_CONFIG_TEMPLATE = '''"""The resolved config of this run, written by the decoupled launcher."""

import json

from decoupled_diloco import config as c


def get_config():
    return c.as_config_dict(c.from_config_dict(json.loads(r"""{values}""")))
'''


def write_config_file(config: config_lib.ExperimentConfig, path: pathlib.Path) -> pathlib.Path:
    """Writes `config` as a config file that `--config=` accepts in any process."""
    path.write_text(_CONFIG_TEMPLATE.format(values=json.dumps(dataclasses.asdict(config))))
    return path


def child_env(token: str) -> dict[str, str]:
    """A child's environment: the run token, without an inherited fake-device count.

    Each learner then fakes exactly the devices its own mesh needs.
    """
    env = dict(os.environ)
    env[wire.TOKEN_ENV] = token
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env


def syncer_command(config_file: pathlib.Path, port_file: pathlib.Path) -> list[str]:
    """The syncer's command line (loopback, any free port, written to `port_file`)."""
    return [
        sys.executable,
        "-m",
        "decoupled_diloco.syncer",
        f"--config={config_file}",
        "--host=127.0.0.1",
        "--port=0",
        f"--port_file={port_file}",
    ]


def learner_command(
    config_file: pathlib.Path, address: str, learner_id: int, summary: pathlib.Path
) -> list[str]:
    """Learner `learner_id`'s command line."""
    return [
        sys.executable,
        "-m",
        "decoupled_diloco.learner",
        f"--config={config_file}",
        f"--syncer={address}",
        f"--learner_id={learner_id}",
        f"--summary={summary}",
    ]


class Processes:
    """Children started with their output in log files; `reap()` ends all of them."""

    def __init__(self, log_dir: pathlib.Path, env: dict[str, str]):
        self.log_dir, self.env = log_dir, env
        self.procs: dict[str, subprocess.Popen] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        """Starts one child; its stdout and stderr go to `log_dir/NAME.log`."""
        from decoupled_diloco.procs import die_with_parent

        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=pathlib.Path(__file__).resolve().parent.parent,
                preexec_fn=die_with_parent,
            )
        self.procs[name] = proc
        return proc

    def failed(self) -> dict[str, int]:
        """Children that exited with a non-zero code."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a child's log."""
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def reap(self) -> None:
        """Terminates and reaps every child."""
        from decoupled_diloco.procs import reap

        reap(list(self.procs.values()))


def _wait_for_port(port_file: pathlib.Path, procs: Processes, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if procs.failed():
            raise RuntimeError(f"the syncer exited early:\n{procs.tail('syncer')}")
        time.sleep(0.05)
    raise TimeoutError(f"the syncer did not start within {timeout_s:.0f}s")


def progress_line(status: dict[str, Any], total_steps: int, elapsed: float) -> str:
    """One line for all learners: state, step, loss and fragment versions, plus merges."""
    parts = []
    for i, info in status["learners"].items():
        loss = info["loss"]
        loss_text = f"{loss:.3f}" if loss == loss else "-"
        parts.append(
            f"L{i} {info['state'][:5]} {info['step']}/{total_steps} loss {loss_text} "
            f"v{info['versions']}"
        )
    return f"[decoupled] {elapsed:5.0f}s | " + " | ".join(parts) + f" | merges {status['merges']}"


def run_decoupled(
    config: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path | None,
    corpus: Any = None,
    progress_s: float = 2.0,
) -> tuple[dict[str, Any], Any]:
    """Runs a syncer and `num_learners` learners to the end; returns (summary, params).

    Raises:
      RuntimeError: a child process failed (its log tail is in the message).
    """
    import tempfile

    t_start = time.perf_counter()
    # Absolute: the children run from the package's root, not from the caller's directory.
    workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="decoupled_")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = write_config_file(config, workdir / "config.py")
    port_file = workdir / "syncer.port"
    port_file.unlink(missing_ok=True)
    token = config.decoupled.syncer.token or os.environ.get(wire.TOKEN_ENV) or secrets.token_hex(16)
    procs = Processes(workdir / "logs", child_env(token))
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM would otherwise end Python without running `finally`: turn it into an exit.
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        procs.start("syncer", syncer_command(config_file, port_file))
        address = f"127.0.0.1:{_wait_for_port(port_file, procs, timeout_s=180)}"
        summaries = [workdir / f"learner_{i}.json" for i in range(config.num_learners)]
        for i in range(config.num_learners):
            summaries[i].unlink(missing_ok=True)
            procs.start(f"learner_{i}", learner_command(config_file, address, i, summaries[i]))
        client = SyncerClient(address, config.decoupled.syncer, token)
        evaluator = GlobalEvaluator(config, client, corpus)
        status = _monitor(config, procs, client, evaluator, workdir, t_start, progress_s)
        learners = [json.loads(path.read_text()) for path in summaries]
        params, eval_loss = evaluator()
        client.close()
    finally:
        procs.reap()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary = {
        "mode": config.mode,
        "num_learners": config.num_learners,
        "inner_steps": config.inner_steps,
        "train_steps": config.train_steps,
        "steps_done": min(x["steps"] for x in learners),
        "tokens": sum(x["tokens"] for x in learners),
        "wall_s": time.perf_counter() - t_start,
        "train_wall_s": max(x["train_wall_s"] for x in learners),
        "final_eval_loss": eval_loss,
        "final_train_loss": float(np.mean([x["final_loss"] for x in learners])),
        "outer_syncs": status["merges"],
        "merge_sizes": status["merge_sizes"],
        "fragments": status["fragments"],
        "stall_fraction_max": max(x["stall_fraction"] for x in learners),
        "learners": learners,
        "params": int(sum(x.size for x in params_leaves(params))),
        "config": dataclasses.asdict(config),
    }
    write_summary(workdir, summary)
    return summary, params


def params_leaves(params: Any) -> list[np.ndarray]:
    """The leaves of a parameter tree."""
    import jax

    return jax.tree.leaves(params)


def _monitor(
    config: config_lib.ExperimentConfig,
    procs: Processes,
    client: SyncerClient,
    evaluate: GlobalEvaluator,
    workdir: pathlib.Path,
    t_start: float,
    progress_s: float,
) -> dict[str, Any]:
    """Polls the syncer until every learner has exited; writes metrics and progress.

    Every `eval.every` steps (mean over learners) it also evaluates the global parameters, the
    model the syncer would hand out, as the synchronous modes evaluate theirs.
    """
    next_eval = config.eval.every
    writer = MetricsWriter(workdir)
    learner_names = [f"learner_{i}" for i in range(config.num_learners)]
    status: dict[str, Any] = {"merges": 0, "learners": {}}
    try:
        while True:
            failed = procs.failed()
            if failed:
                name = sorted(failed)[0]
                raise RuntimeError(f"{name} exited with code {failed[name]}:\n{procs.tail(name)}")
            done = all(procs.procs[n].poll() is not None for n in learner_names)
            try:
                status = client.status()
            except Exception as error:  # noqa: BLE001 - report and keep watching the children.
                print(f"[decoupled] status failed: {error}", flush=True)
            elapsed = time.perf_counter() - t_start
            learners = status["learners"]
            if learners:
                steps = [x["step"] for x in learners.values()]
                event: dict[str, Any] = {}
                if config.eval.every and np.mean(steps) >= next_eval:
                    event["eval_loss"] = evaluate()[1]
                    while next_eval <= np.mean(steps):
                        next_eval += config.eval.every
                # NaN (no step yet) becomes null: every line stays valid JSON.
                losses = [x["loss"] if x["loss"] == x["loss"] else None for x in learners.values()]
                evals = [
                    x["eval_loss"] for x in learners.values() if x["eval_loss"] == x["eval_loss"]
                ]
                print(progress_line(status, config.train_steps, elapsed), flush=True)
                writer.write(
                    step=int(np.mean(steps)),
                    tokens=sum(x["tokens"] for x in learners.values()),
                    loss=float(np.mean([v for v in losses if v is not None]))
                    if any(v is not None for v in losses)
                    else None,
                    learner_losses=losses,
                    learner_steps=steps,
                    learner_states=[x["state"] for x in learners.values()],
                    versions=[f["version"] for f in status["fragments"]],
                    wall_s=elapsed,
                    outer_syncs=status["merges"],
                    **({"learner_eval_loss": float(np.mean(evals))} if evals else {}),
                    **event,
                )
            if done:
                return _wait_for_last_merges(client, status)
            time.sleep(progress_s)
    finally:
        writer.close()


def _wait_for_last_merges(client: SyncerClient, status: dict[str, Any]) -> dict[str, Any]:
    """After the learners exit, their final pushes close within the syncer's next tick."""
    deadline = time.monotonic() + 30
    while any(f["pending"] for f in status["fragments"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        status = client.status()
    return status


class GlobalEvaluator:
    """Evaluates the syncer's global parameters (pulled fragment by fragment) on one device."""

    def __init__(self, config: config_lib.ExperimentConfig, client: SyncerClient, corpus: Any):
        import jax

        from decoupled_diloco import data as data_lib
        from decoupled_diloco import fragments as F
        from decoupled_diloco.island import Island

        self.config, self.client = config, client
        self.island = Island(config, jax.devices()[:1], mesh_shape=(1, 1))
        specs = F.tensor_specs(self.island.abstract_params)
        self.cut = F.partition(specs, config.decoupled.fragments)
        self.num_leaves = len(specs)
        corpus = corpus or data_lib.load_corpus(config.data.path, config.data.val_fraction)
        self.batches = data_lib.validation_batches(
            corpus.val_BN, config.model.seq_len, config.data.batch_size, config.eval.batches
        )

    def params(self) -> Any:
        """The current global parameters, as a host pytree."""
        import jax

        leaves: list[Any] = [None] * self.num_leaves
        for p, fragment in enumerate(self.cut):
            _, values = self.client.pull(-1, p, 0, self.config.decoupled.syncer.rpc_timeout_s)
            for spec, value in zip(fragment, values, strict=True):
                leaves[spec.index] = value
        return jax.tree.unflatten(jax.tree.structure(self.island.abstract_params), leaves)

    def __call__(self) -> tuple[Any, float]:
        """(global parameters, their mean validation loss)."""
        params = self.params()
        return params, self.island.evaluate(params, self.batches)
