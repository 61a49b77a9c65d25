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
import os
import pathlib
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import config as config_lib
from decoupled_diloco import runtime, tasks
from decoupled_diloco.comm import auth, wire
from decoupled_diloco.comm.shards import syncer_client
from decoupled_diloco.data import dataset as dataset_lib
from decoupled_diloco.local import chaos_run, poll, wan
from decoupled_diloco.local import supervisor as supervisor_lib
from decoupled_diloco.local.commands import (
    child_env,
    island_commands,
    metrics_flags,
    syncer_command,
)
from decoupled_diloco.local.evaluator import GlobalEvaluator
from decoupled_diloco.local.job_summary import job_summary, learner_summaries, print_ledger
from decoupled_diloco.local.procs import Processes, free_port
from decoupled_diloco.obs import monitor as monitor_lib
from decoupled_diloco.obs.metrics import make_writers, write_summary
from decoupled_diloco.obs.writers import close_all


def _start_syncers(
    config: config_lib.ExperimentConfig,
    config_file: pathlib.Path,
    workdir: pathlib.Path,
    port_file: pathlib.Path,
    supervisor: Any,
    procs: Processes,
    shaping: wan.Shaping,
) -> tuple[list[int], dict[str, str]]:
    """Starts the `syncer.shards` syncer processes; returns their ports and metrics URLs.

    The metrics URLs come by process name (`monitor.enabled`; the learners' are added to it as
    they are started). Each shard gets a fixed free port (a
    restart comes back on it) and its own directory
    `workdir/checkpoints/syncer_S` (write-ahead log and snapshots, unless
    `decoupled.syncer.durable` is off): a restart loses nothing a learner was told. One shard
    is named `syncer`.
    """
    shards = config.decoupled.syncer.shards
    metrics_urls = {}
    port_files = [port_file] + [workdir / f"syncer_{s}.port" for s in range(1, shards)]
    for s in range(shards):
        port_files[s].unlink(missing_ok=True)
        durable = config.decoupled.syncer.durable
        if durable and not config.checkpoint.every:
            # Learners without checkpoints start afresh, so must the syncer: an old run's state
            # in a reused workdir would otherwise come back (with checkpoints, both resume).
            shutil.rmtree(workdir / "checkpoints" / f"syncer_{s}", ignore_errors=True)
        directory = workdir / "checkpoints" / f"syncer_{s}" if durable else None
        command = syncer_command(
            config_file, port_files[s], free_port(), s, directory, shaping.syncer_host
        )
        name = "syncer" if shards == 1 else f"syncer_{s}"
        command += metrics_flags(workdir, name, config, metrics_urls)
        supervisor.add(name, shaping.syncer(command))
    return [procs.wait_for_port(f, timeout_s=180) for f in port_files], metrics_urls


def _python() -> str:
    """This interpreter as the user would type it (`.venv/bin/python` from the repository)."""
    try:
        return str(pathlib.Path(sys.executable).relative_to(pathlib.Path.cwd()))
    except ValueError:
        return sys.executable


def _shown(path: pathlib.Path) -> str:
    """`path` relative to the current directory when it is below it."""
    try:
        return str(path.relative_to(pathlib.Path.cwd().absolute()))
    except ValueError:
        return str(path)


@dataclasses.dataclass
class _Job:
    """One decoupled run while it runs: what it was given, its processes and their controls.

    The run's token reaches the syncers through the environment, never through the config file
    the learners read too (each learner gets only its own credential).
    """

    config: config_lib.ExperimentConfig
    workdir: pathlib.Path
    token: str
    config_file: pathlib.Path
    task: Any
    data: Any
    schedule: Any
    procs: Processes
    events: supervisor_lib.EventLog
    supervisor: supervisor_lib.Supervisor
    shaping: wan.Shaping = dataclasses.field(default_factory=wan.Shaping)
    monitor: Any = None
    injector: Any = None


def run_decoupled(
    config: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path | None,
    corpus: Any = None,
    progress_s: float = 2.0,
    task: Any = None,
    writers: Sequence[Any] = (),
) -> tuple[dict[str, Any], Any, Any]:
    """Runs a syncer and `num_learners` learners to the end; returns (summary, params, monitor).

    A user's task (`config.task`) is imported by every process; `task` is this process's copy
    of it (the evaluator's; default: `make_task(config)`). With `monitor.enabled` every process
    serves Prometheus metrics and the job page is served (`obs.monitor`); `monitor` is that
    page, still up with the final state, for the caller to `stop()` (else None). `writers` (the
    user's own metric writers) get the job's metrics beside those `config.metrics` names.

    Raises:
      RuntimeError: a child process failed (its log tail is in the message).
    """
    t_start = time.perf_counter()
    job = _prepare(config, workdir, corpus, task)
    failed = handed = False
    # Ctrl+C and SIGTERM run the `finally` below (children, namespaces), within a bound.
    restore_signals = runtime.exit_on_signals()
    try:
        # The metric writers (a W&B run starts here), before any process is started.
        writers = make_writers(job.config, job.workdir) + list(writers)
        client, evaluator = _start(job)
        handed = True  # the watch closes the writers, whatever happens there
        status = poll.watch(
            job.config, job.supervisor, client, evaluator, job.workdir, t_start, progress_s,
            writers,
        )  # fmt: skip
        learners, params, eval_loss = _evaluate(job, client, evaluator)
    except BaseException:
        failed = True
        if not handed:  # (a W&B run started above is finished, not left open)
            close_all(writers)
        raise
    finally:
        links = _tear_down(job, failed)
        restore_signals()
    summary = job_summary(
        job.config, job.task, learners, status, evaluator, eval_loss, params, job.workdir,
        job.events, links, t_start,
    )  # fmt: skip
    _write_summary(job, summary)
    return summary, params, job.monitor


def _prepare(
    config: config_lib.ExperimentConfig, workdir: str | pathlib.Path | None, corpus: Any, task: Any
) -> _Job:
    """Everything checked and written before any process starts: config, token, task, data."""
    import tempfile

    # Absolute: the children run from the package's root, not from the caller's directory.
    workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="decoupled_")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    # Timeline (goodput) and, under `config.chaos`, the fault schedule and its controls.
    config, chaos_env, schedule = chaos_run.prepare_run(config, workdir)
    token = (
        config.decoupled.syncer.token.strip()
        or os.environ.get(wire.TOKEN_ENV, "").strip()
        or secrets.token_hex(16)
    )
    config = config_lib.replace(config, **{"decoupled.syncer.token": ""})
    config_file = config_lib.write_config_file(config, workdir / "config.py")
    task = task or tasks.make_task(config)  # fails here, before any process starts
    if corpus is None and task.dataset is None:
        dataset_lib.check_workdir_data(config, workdir)
    # The data is read (and so checked) here, before any process starts; the evaluator uses it.
    data = dataset_lib.load_dataset(config, corpus, task)
    procs = Processes(
        workdir / "logs",
        {**child_env(token), **chaos_env, "PYTHONPATH": tasks.python_path(config)},
    )
    events = supervisor_lib.EventLog(workdir, time.monotonic())
    supervisor = supervisor_lib.Supervisor(procs, workdir / "timeline", events, config.supervisor)
    return _Job(
        config, workdir, token, config_file, task, data, schedule, procs, events, supervisor
    )


def _start(job: _Job) -> tuple[Any, GlobalEvaluator]:
    """Starts the syncers, the learners, the supervisor, the page and the faults.

    Returns the client of the syncers and the evaluator of their global model.
    """
    config, workdir, supervisor = job.config, job.workdir, job.supervisor
    job.shaping = _shaping(config, workdir, job.schedule)
    port_file = workdir / "syncer.port"
    ports, metrics_urls = _start_syncers(
        config, job.config_file, workdir, port_file, supervisor, job.procs, job.shaping
    )
    address = job.shaping.address(ports)  # where this process (evaluator, status) reaches them
    (workdir / "syncer.address").unlink(missing_ok=True)
    if job.shaping.lab is not None:  # for `status --workdir`: the syncers are not on loopback
        (workdir / "syncer.address").write_text(address)
    # Owner-only, so that `status --workdir=WORKDIR` can watch this local run.
    fd = os.open(workdir / "run_token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(job.token)
    print(
        f"[decoupled] syncer at {address}; to watch it live from another terminal: "
        f"{_python()} -m decoupled_diloco.status --workdir={_shown(workdir)} --watch",
        flush=True,
    )
    if job.schedule is not None and config.supervisor.standby:  # warm spares for restarts
        from decoupled_diloco.learner.standby import Spares

        supervisor.spares = Spares(
            job.procs, workdir / "standby", job.config_file,
            config_lib.parse_mesh_shapes(config), config.supervisor.standby, workdir / "timeline",
        )  # fmt: skip
    start_learner = _learner_starter(
        config, workdir, job.config_file, job.token, ports, metrics_urls, job.shaping, supervisor
    )
    for i in range(config.num_learners):
        start_learner(i)
    # Joins and leaves: the chaos schedule's, and `status --add_learner/--remove_learner`.
    supervisor.spawn, supervisor.scale_dir = start_learner, workdir
    client = syncer_client(address, config.decoupled.syncer, job.token)
    if config.monitor.enabled:
        job.monitor = _start_monitor(config, address, job.token, workdir, metrics_urls)
    supervisor.start_thread()
    if job.schedule is not None:
        job.injector = chaos_run.start_injector(job.schedule, supervisor, workdir, client)
    return client, GlobalEvaluator(config, client, job.data, job.task)


def _evaluate(job: _Job, client: Any, evaluator: GlobalEvaluator) -> tuple[list, Any, float]:
    """After the watch: faults stopped, the learners' summaries, the global model evaluated."""
    if job.injector is not None:
        job.injector.halt.set()
        job.supervisor.settle(timeout_s=300)  # a syncer killed late is back before the eval
        client.wait_ready(120)
    learners = learner_summaries(job.supervisor, job.workdir)
    params, eval_loss = evaluator()
    if job.monitor is not None:  # the last poll, while the syncer still answers
        job.monitor.finish(f"training finished: final eval loss {eval_loss:.4f}")
    client.close()
    return learners, params, eval_loss


def _tear_down(job: _Job, failed: bool) -> dict[str, Any]:
    """Every child stopped and reaped, the links removed; what each link carried (if shaped).

    Each step runs even if the one before it failed or a signal cut it short.
    """
    if job.injector is not None:
        job.injector.halt.set()
    try:
        job.supervisor.stop()
        job.procs.reap()
    finally:
        try:
            links = {} if failed else job.shaping.report()  # (the kernel's counts, then gone)
        finally:
            job.shaping.close()  # (after the children are gone)
            if failed and job.monitor is not None:  # (after the children: never delays them)
                job.monitor.stop()
    return links


def _write_summary(job: _Job, summary: dict[str, Any]) -> None:
    """summary.json (and under faults the timeline's picture); the page notes where it is."""
    if (ledger := summary["data_ledger"]) is not None:  # the invariant, checked every run
        print_ledger(ledger)
    try:
        path = write_summary(job.workdir, summary)
        if job.schedule is not None:  # under faults: the picture of who did what when
            chaos_run.write_timeline_png(job.workdir)
    except BaseException:
        if job.monitor is not None:
            job.monitor.stop()
        raise
    if job.monitor is not None:  # the page stays up (the caller stops it) with the final state
        job.monitor.note(f"summary: {path}")


def _learner_starter(
    config: config_lib.ExperimentConfig,
    workdir: pathlib.Path,
    config_file: pathlib.Path,
    token: str,
    ports: Any,
    metrics_urls: dict[str, str],
    shaping: wan.Shaping,
    supervisor: supervisor_lib.Supervisor,
) -> Callable[[int], None]:
    """What starts learner i's process(es) under `supervisor`, at the start or when it joins."""

    def start_learner(i: int) -> None:
        """Starts learner i's process(es): a starting learner, or one that joins."""
        if i >= config.num_learners and not config_lib.data_leases(config):
            raise ValueError(
                f"learner {i} cannot join: learners beyond num_learners={config.num_learners}"
                " need data leases (decoupled.data_shards > 0, one syncer shard)"
            )
        if not 0 <= i < config_lib.max_learners(config):
            raise ValueError(
                f"learner {i} cannot join: ids stop at decoupled.max_learners="
                f"{config_lib.max_learners(config)}"
            )
        summary = workdir / f"learner_{i}.json"
        summary.unlink(missing_ok=True)
        metrics = metrics_flags(workdir, f"learner_{i}", config, metrics_urls)
        reach = [shaping.address(ports, i, j) for j in range(config.decoupled.island_processes)]
        island = island_commands(
            config, config_file, reach, i, summary, shaping.coordinator_host(i)
        )
        for j, (name, command) in enumerate(island):
            leader = j == 0
            # A learner holds only its own credential: it can act as itself, not as others
            # (and the metrics-only scrape secret its metrics accept: `learner.metrics`).
            env = {
                **chaos_run.learner_env(i, leader),
                wire.TOKEN_ENV: auth.learner_credential(token, i),
                **({auth.SCRAPE_ENV: auth.scrape_secret(token)} if metrics else {}),
                **shaping.env,  # the in-process pacer's controls, if it paces
            }
            command = shaping.learner(i, command + metrics, j)
            supervisor.add(name, command, learners=[i], env=env)

    return start_learner


def _shaping(
    config: config_lib.ExperimentConfig, workdir: pathlib.Path, schedule: Any
) -> wan.Shaping:
    """`decoupled.wan_mbit`: each learner behind a kernel rate limit (`local.wan`).

    Where the kernel cannot shape, the learners' links are paced in-process instead, through
    their control files.
    """
    pacer_dir = workdir / "wan_pacer"
    shutil.rmtree(pacer_dir, ignore_errors=True)
    d = config.decoupled
    try:
        shaping = wan.shaping_for(
            d.wan_mbit, config.num_learners, str(pacer_dir), d.island_processes,
            per_process=d.wan_sites == "process",
        )  # fmt: skip
    except wan.WanError as error:
        raise config_lib.ConfigError(f"config.decoupled.wan_sites: {error}") from None
    if shaping.kind == "pacer" and schedule is not None:
        shaping.close()
        raise config_lib.ConfigError(
            f"config.decoupled.wan_mbit: {shaping.line}; but the in-process pacer would share "
            "the learners' fault controls with config.chaos: run one of them, or run where the "
            "kernel can shape (root, iproute2)"
        )
    if shaping.line:
        print(f"[decoupled] {shaping.line}", flush=True)
    return shaping


def _start_monitor(
    config: config_lib.ExperimentConfig,
    address: str,
    token: str,
    workdir: pathlib.Path,
    metrics_urls: dict[str, str],
) -> Any:
    """`monitor.enabled`: the job page (`obs.monitor`); its URL and the metrics' printed.

    The scrape secret (`comm.auth.scrape_secret`) goes to `workdir/scrape_token` (owner-only)
    for Prometheus. The page polls with a client of its own, with short timeouts: a paused or
    restarting syncer makes it say so within seconds rather than hold it.
    """
    m = config.monitor
    scrape = auth.scrape_secret(token)
    fd = os.open(workdir / "scrape_token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(scrape)
    quick = dataclasses.replace(config.decoupled.syncer, rpc_timeout_s=5.0, retries=1)
    title = f"decoupled run: {config.num_learners} learners, {_shown(workdir)}"
    monitor = monitor_lib.Monitor(
        syncer_client(address, quick, token), token, m.host, m.port, workdir, m.refresh_s, title,
        scrape_secret=scrape, close_client=True,
    ).start()  # fmt: skip
    urls = ", ".join(f"{name} {url}" for name, url in metrics_urls.items())
    print(
        f"[decoupled] job page: {monitor.login_url()}\n[decoupled] Prometheus metrics: {urls} "
        f"(bearer token: {_shown(workdir / 'scrape_token')}; scrape targets: "
        f"{_shown(workdir / monitor_lib.TARGETS_FILE)}; docs/operations.md)",
        flush=True,
    )
    return monitor
