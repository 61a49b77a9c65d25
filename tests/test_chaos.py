"""Fault schedules, goodput/uptime math on hand-made timelines, controls, and the supervisor.

The supervisor test uses real processes and real signals (a sleeping Python child).
"""

import json
import statistics
import sys
import time

import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.chaos import faults as chaos
from decoupled_diloco.local.chaos_run import start_injector
from decoupled_diloco.local.procs import Processes
from decoupled_diloco.local.supervisor import EventLog, Supervisor
from decoupled_diloco.obs import timeline as tl
from tests.helpers import ROOT, wait_until

R = tl.Record


def _write(path, text):
    path.write_text(text)
    return path


# Schedules -----------------------------------------------------------------------------------


def test_generated_schedule_is_seeded_and_reproducible(tmp_path):
    text = "seed: 3\nfailure_model: {mtbf_s: 120, repair_s: 20, duration_s: 600}\n"
    path = _write(tmp_path / "a.yaml", text)
    first, again = chaos.load(path, 4), chaos.load(path, 4)
    assert first == again and first.faults
    other = chaos.load(_write(tmp_path / "b.yaml", text.replace("seed: 3", "seed: 4")), 4)
    assert other.faults != first.faults
    # Adding learners leaves the first ones' failures where they were.
    assert [f for f in chaos.load(path, 6).faults if f.learner < 4] == list(first.faults)
    for learner in range(4):
        times = [f.at_s for f in first.faults if f.learner == learner]
        assert all(b - a >= 20 for a, b in zip(times, times[1:], strict=False))  # repair first
        assert all(0 <= t < 600 for t in times)
    assert all(f.kind == "kill" and f.repair_s == 20 for f in first.faults)
    # The gaps are exponential with the given mean (long horizon, loose bound).
    model = chaos.FailureModel(mtbf_s=120, repair_s=20, duration_s=2_000_000, seed=0)
    times = [f.at_s for f in chaos.generate(model, 1)]
    gaps = [b - a - 20 for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(120, rel=0.05)


def test_schedule_file_mixes_explicit_faults_and_orders_them(tmp_path):
    path = _write(
        tmp_path / "s.yaml",
        "faults:\n"
        "  - {at_s: 30, kind: pause, learner: 1, duration_s: 5}\n"
        "  - {at_step: 120, kind: kill, learner: 0, repair_s: 10}\n"
        "  - {at_s: 5, kind: link, learner: 0, drop: 0.3, latency_s: 0.02}\n"
        "  - {at_s: 60, kind: kill_syncer, repair_s: 3, during_merge: true}\n",
    )
    faults = chaos.load(path, 2).faults
    assert [f.kind for f in faults] == ["link", "pause", "kill_syncer", "kill"]
    assert faults[-1].at_step == 120 and faults[0].drop == 0.3


@pytest.mark.parametrize(
    "body, message",
    [
        ("faults: [{at_s: 1, kind: explode, learner: 0}]", "faults[0].kind"),
        ("faults: [{at_s: 1, kind: kill, learner: 0, color: red}]", "faults[0].color"),
        ("faults: [{at_s: 1, kind: kill, learner: 5}]", "faults[0].learner: no learner 5"),
        ("faults: [{at_s: 1, at_step: 3, kind: kill, learner: 0}]", "exactly one of at_s"),
        ("faults: [{at_s: 1, kind: link, learner: 0, drop: 1.5}]", "faults[0].drop"),
        ("faults: [{at_s: -1, kind: kill, learner: 0}]", "faults[0].at_s"),
        ("faults: [{at_s: 1, kind: slow, learner: 0, factor: 0.5}]", "faults[0].factor"),
        ("faults: [{at_s: 1, kind: kill, learner: one}]", "faults[0].learner: expected an int"),
        ("failure_model: {mtbf_s: 0, repair_s: 1, duration_s: 9}", "failure_model.mtbf_s"),
        ("failure_model: {mtbf_s: 10, repair_s: 1}", "failure_model.duration_s"),
        ("fautls: []", "fautls: no such field"),
        ("faults: [1, 2", "not valid YAML"),
    ],
)
def test_bad_schedules_name_the_problem(tmp_path, body, message):
    with pytest.raises(chaos.ChaosError, match=message.replace("[", r"\[").replace("]", r"\]")):
        chaos.load(_write(tmp_path / "bad.yaml", body + "\n"), 2)


def test_config_names_a_missing_schedule():
    from decoupled_diloco import config as config_lib

    with pytest.raises(config_lib.ConfigError, match="config.chaos"):
        config_lib.replace(config_lib.ExperimentConfig(), chaos="no/such/schedule.yaml")


def test_checked_in_schedules_load():
    paths = sorted((ROOT / "experiments" / "chaos").glob("*.yaml"))
    assert len(paths) >= 5, paths  # demo, every_fault, flaky_link, kill_restart, mtbf120
    for path in paths:
        assert chaos.load(path, 4, max_learners=6).faults, path  # (elastic.yaml: 4 -> 6 -> 3)


# Goodput and uptime on hand-made timelines ---------------------------------------------------


def test_goodput_of_a_decoupled_learner_killed_and_rolled_back():
    # Learner 0: starts 0-2, compiles step 1 (2-3), steps 2..5 one second each (3-7), killed at 7,
    # down for repair 7-17, restarts 17-19, restores its checkpoint of step 3, compiles step 4
    # (19-20), steps 5..6 (20-22), done at 22. Steps 4 and 5 of the first life are lost.
    l0 = [
        R(0, "starting"),
        R(2, "compiling", 1),
        *[R(3 + i, "stepping", 2 + i) for i in range(4)],  # steps 2, 3, 4, 5
        R(7, "down"),
        R(17, "starting"),
        R(19, "compiling", 4),
        R(20, "stepping", 5),
        R(21, "stepping", 6),
        R(22, "done"),
    ]
    # Learner 1 never fails: starts 0-2, compiles 2-3, steps 3..22 (19 steps), done.
    l1 = [R(0, "starting"), R(2, "compiling", 1)]
    l1 += [R(3 + i, "stepping", 2 + i) for i in range(19)] + [R(22, "done")]
    s0 = tl.learner_stats(l0, t_end=30)
    assert s0.down_s == 10 and s0.allocated_s == 22 - 10
    assert s0.lost_steps == 2  # steps 4 and 5 of the first life, executed again
    assert s0.productive_s == pytest.approx(1 + 1 + 1 + 1)  # steps 2, 3, then 5, 6
    result = tl.analyze({0: l0, 1: l1}, t_end=30)
    assert result.goodput == pytest.approx((4 + 19) / (12 + 22))
    assert result.uptime == 1.0  # learner 1 stepped through learner 0's outage
    assert result.lost_steps == 2 and result.window_s == 19


def test_goodput_and_uptime_of_a_synchronous_group_stopped_by_one_failure():
    # Two learners in one process: step 1 compiles 0-1, steps 2..4 (1-4), learner 1 fails at 4:
    # it is down 4-14 while learner 0 waits; restart 14-16, restore of step 2, compile step 3
    # (16-17), step 4 (17-18), done at 18.
    group = [
        R(0, "compiling", 1),
        R(1, "stepping", 2),
        R(2, "stepping", 3),
        R(3, "stepping", 4),
        R(14, "starting"),
        R(16, "compiling", 3),
        R(17, "stepping", 4),
        R(18, "done"),
    ]
    l0 = sorted(group + [R(4, "waiting")], key=lambda r: r.t)
    l1 = sorted(group + [R(4, "down")], key=lambda r: r.t)
    result = tl.analyze({0: l0, 1: l1})
    # Productive: step 2 (1 s) and the second step 4 (1 s), for each learner. Allocated:
    # 18 s for learner 0, 18 - 10 = 8 s for learner 1.
    assert result.goodput == pytest.approx(4 / (18 + 8))
    assert result.lost_steps == 4  # steps 3 and 4 of the first life, both learners
    # Window 1..18; the group steps 1-4 and 17-18: 4 of 17 s.
    assert result.uptime == pytest.approx(4 / 17)


def test_pause_and_blocked_time_are_allocated_but_not_productive():
    records = [R(0, "stepping", 1), R(1, "paused"), R(4, "blocked"), R(5, "stepping", 2)]
    records.append(R(6, "done"))
    stats = tl.learner_stats(records, t_end=6)
    assert stats.allocated_s == 6 and stats.productive_s == 2 and stats.lost_steps == 0


def test_timeline_files_round_trip_and_cut_lines_are_skipped(tmp_path):
    writer = tl.Timeline(tmp_path, "trainer", [0, 1])
    writer.enter("starting", t=1.0)
    writer.enter("stepping", step=1, t=2.0)
    other = tl.Timeline(tmp_path, "supervisor", [])
    other.enter("down", t=3.0, learners=[1])
    with open(tmp_path / "trainer.jsonl", "a") as f:
        f.write('{"t": 4.0, "state": "step')  # a line cut short by kill -9
    loaded = tl.load(tmp_path)
    assert [r.state for r in loaded[0]] == ["starting", "stepping"]
    assert [r.state for r in loaded[1]] == ["starting", "stepping", "down"]
    assert tl.current_step(tmp_path / "trainer.jsonl") == 1
    with pytest.raises(ValueError, match="unknown timeline state"):
        writer.enter("napping")


# Controls and the supervisor (real processes) ------------------------------------------------


def test_controls_are_reread_when_the_file_changes(tmp_path):
    controls = chaos.Controls(chaos.control_path(tmp_path, 0))
    assert controls.slowdown() == 1.0 and controls.get() == {}
    chaos.write_controls(tmp_path, 0, {"slowdown": 3.0})
    assert controls.slowdown() == 3.0
    chaos.write_controls(tmp_path, 0, {"slowdown": 1.0, "drop": 0.3})
    assert controls.get()["drop"] == 0.3 and controls.slowdown() == 1.0


@pytest.mark.multiprocess
def test_supervisor_plays_a_schedule_on_real_processes(tmp_path):
    schedule = chaos.parse(
        {
            "faults": [
                {"at_s": 0, "kind": "kill", "learner": 0, "repair_s": 0.5},
                {"at_s": 0, "kind": "pause", "learner": 1, "duration_s": 0.3},
                {"at_s": 0, "kind": "slow", "learner": 1, "factor": 4, "duration_s": 0.3},
            ]
        }
    )[0]
    procs = Processes(tmp_path / "logs", {"PATH": "/usr/bin:/bin"})
    log = EventLog(tmp_path, time.monotonic())
    policy = config_lib.SupervisorConfig(restart_backoff_s=0.1, crash_loop=2, min_uptime_s=60)
    supervisor = Supervisor(procs, tmp_path / "timeline", log, policy)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    injector = None
    try:
        first = supervisor.add("learner_0", sleeper, learners=[0])
        supervisor.add("learner_1", sleeper, learners=[1])
        supervisor.start_thread()
        injector = start_injector(schedule, supervisor, tmp_path)
        wait_until(lambda: log.recoveries >= 3, 20, "the restart, the resume and the speed-up")
        restarted = supervisor.children["learner_0"].proc
        assert restarted.pid != first.pid and restarted.poll() is None
        assert first.returncode == -9  # killed, not asked to stop
        assert supervisor.children["learner_0"].restarts == 1
        assert log.faults == 3
        assert chaos.Controls(chaos.control_path(tmp_path / "chaos", 1)).slowdown() == 1.0
        supervisor.check()  # a killed child is not an error
        # A child that dies on its own (killed from outside) is restarted after the backoff...
        outside = supervisor.children["learner_1"].proc
        outside.kill()
        wait_until(lambda: log.recoveries >= 4, 20, "the restart after a death from outside")
        again = supervisor.children["learner_1"].proc
        assert again.pid != outside.pid and again.poll() is None
        supervisor.check()
        # ...and a second quick death in a row is a crash loop (crash_loop=2), which ends the run.
        again.kill()
        wait_until(lambda: supervisor.error is not None, 20, "the crash loop to be noticed")
        with pytest.raises(RuntimeError, match="learner_1 is crash-looping: it died 2 times"):
            supervisor.check()
    finally:
        if injector is not None:
            injector.stop()
        supervisor.stop()
        procs.reap()
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e.get("kind")) for e in events]
    assert ("fault", "kill") in kinds and ("recovery", "restart") in kinds
    crashes = [e for e in events if e["event"] == "crash"]
    assert [(e["process"], e["code"], e["deaths"]) for e in crashes] == [("learner_1", -9, 1)]
    assert ("fault", "pause") in kinds and ("recovery", "pause") in kinds
    assert all("wall_s" in e and "time" in e for e in events)
    records = tl.load(tmp_path / "timeline")
    assert [r.state for r in records[0]] == ["starting", "down", "starting"]
    assert [r.state for r in records[1]] == ["starting", "paused", "blocked", "down", "starting"]
    down, restart = records[0][1].t, records[0][2].t
    assert restart - down >= 0.5  # restarted only after the repair time


@pytest.mark.multiprocess
def test_a_child_that_keeps_failing_spends_its_restart_budget(tmp_path):
    procs = Processes(tmp_path / "logs", {"PATH": "/usr/bin:/bin"})
    log = EventLog(tmp_path, time.monotonic())
    policy = config_lib.SupervisorConfig(
        max_restarts=2, restart_backoff_s=0.0, crash_loop=100, min_uptime_s=0.0
    )
    supervisor = Supervisor(procs, tmp_path / "timeline", log, policy)
    failing = [sys.executable, "-c", "import sys; print('bad config: x'); sys.exit(3)"]
    try:
        supervisor.add("syncer", failing)
        supervisor.start_thread()
        wait_until(lambda: supervisor.error is not None, 60, "the budget to be spent")
        with pytest.raises(RuntimeError, match=r"syncer died 3 times \(exit code 3") as info:
            supervisor.check()
        assert "max_restarts=2" in str(info.value) and "bad config: x" in str(info.value)
        assert supervisor.children["syncer"].restarts == 2
    finally:
        supervisor.stop()
        procs.reap()


def test_degraded_link_drops_requests_and_replies_and_adds_latency(tmp_path, monkeypatch):
    from concurrent import futures

    import grpc

    from decoupled_diloco.comm import faulty_link

    handled = []

    def echo(request, context):
        handled.append(request)
        return request

    def stream(request, context):
        handled.append(request)
        yield request
        yield request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "t",
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(echo),
                    "Stream": grpc.unary_stream_rpc_method_handler(stream),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv(chaos.DIR_ENV, str(tmp_path))
    chaos.write_controls(tmp_path, 0, {"seed": 0, "drop": 0.3, "latency_s": 0.01})
    link = faulty_link.DegradedLink(chaos.Controls.from_env(0), 0)
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), link)
    try:
        echo_call = channel.unary_unary("/t/Echo")
        outcomes = {"ok": 0, "request": 0, "reply": 0}
        t0 = time.perf_counter()
        for i in range(100):
            try:
                assert echo_call(b"%d" % i, timeout=5) == b"%d" % i
                outcomes["ok"] += 1
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                outcomes[error.where] += 1
        elapsed = time.perf_counter() - t0
        dropped = outcomes["request"] + outcomes["reply"]
        assert 0.2 * 100 < dropped < 0.4 * 100 and outcomes["request"] and outcomes["reply"]
        # A lost reply was handled by the server; a lost request never reached it.
        assert len(handled) == outcomes["ok"] + outcomes["reply"]
        assert elapsed >= 100 * 0.005  # at least the half-latency before every call
        chaos.write_controls(tmp_path, 0, {"seed": 0})  # the fault ends: a clean link
        handled.clear()
        replies = list(channel.unary_stream("/t/Stream")(b"x", timeout=5))
        assert replies == [b"x", b"x"] and handled == [b"x"]
    finally:
        channel.close()
        server.stop(None)


def test_a_push_whose_reply_the_link_lost_is_answered_as_a_duplicate_and_merged_once(tmp_path):
    """Through the chaos link and a real syncer: a push the syncer handled but whose reply was
    lost is re-sent by the client's retry, recognised (duplicate) and never merged twice."""
    from decoupled_diloco.comm import faulty_link
    from decoupled_diloco.comm.client import SyncerClient
    from decoupled_diloco.syncer.server import SyncerServer
    from tests.conftest import tiny_config

    config = tiny_config(mode="decoupled", num_learners=1, **{
        "decoupled.fragments": 1, "decoupled.quorum": 1, "decoupled.syncer.max_grace_s": 0.0,
        "decoupled.syncer.max_staleness": 64, "decoupled.syncer.retries": 8,
    })  # fmt: skip
    server = SyncerServer(config, host="127.0.0.1", port=0, token="t").start()
    # Drops are drawn per method from the seed: the same calls lose the same replies each run.
    chaos.write_controls(tmp_path, 0, {"seed": 0, "drop": 0.3})
    link = faulty_link.DegradedLink(chaos.Controls(chaos.control_path(tmp_path, 0)), 0)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, "t", link=link)
    pushes = 16
    try:
        client.register(0, server.fingerprint)
        fragment = server.state.fragments[0]
        replies = [
            client.push(
                learner_id=0,
                fragment=0,
                round=r,
                base_version=0,
                steps=1,
                tokens=1,
                specs=fragment.specs,
                arrays=[np.full_like(v, 1e-3) for v in fragment.values],
            )  # fmt: skip
            for r in range(pushes)
        ]
        assert all(x.accepted for x in replies)
        lost = sum(x.duplicate for x in replies)  # their first answer was lost on the way back
        assert lost >= 1 and link.dropped["reply"] >= lost, link.dropped
        assert server.state.status()["fragments"][0]["duplicate_pushes"] >= lost
        # Each push merged exactly once (quorum 1: a merge per push), however often it was sent.
        merges = server.state.merge_log
        assert len(merges) == pushes and sum(sum(m["steps"]) for m in merges) == pushes
        assert server.state.fragments[0].version == pushes
    finally:
        client.close()
        server.stop(0)


def test_pictures_of_a_timeline_and_of_goodput_by_mode(tmp_path):
    from decoupled_diloco.obs.timeline_plot import plot_goodput, plot_timeline

    writer = tl.Timeline(tmp_path / "timeline", "learner_0", [0])
    for i, state in enumerate(["starting", "compiling", "stepping", "down", "starting", "done"]):
        writer.enter(state, step=i if state in tl.STEP_STATES else -1, t=100.0 + i)
    event = {"event": "fault", "kind": "kill", "learner": 0, "time": 103.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(event) + "\n")
    png = plot_timeline(tmp_path)
    assert png == tmp_path / "timeline.png" and png.read_bytes()[:4] == b"\x89PNG"
    runs = {"dp": {"goodput": 0.3, "uptime": 0.4}, "decoupled": {"goodput": 0.9, "uptime": 1.0}}
    assert plot_goodput(runs, tmp_path / "goodput.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.multiprocess
def test_a_kill_of_a_carrier_that_just_died_on_its_own_gets_the_repair_time(tmp_path):
    """A fault's kill that finds its carrier already dead (not yet noticed) takes it as its kill:
    restarted after the repair time, not after the crash backoff, and no crash is logged."""
    procs = Processes(tmp_path / "logs", {"PATH": "/usr/bin:/bin"})
    log = EventLog(tmp_path, time.monotonic())
    policy = config_lib.SupervisorConfig(restart_backoff_s=30.0)
    supervisor = Supervisor(procs, tmp_path / "timeline", log, policy)
    try:
        child = supervisor.add("learner_0", [sys.executable, "-c", "raise SystemExit(1)"], [0])
        child.wait(timeout=60)  # dead, and the supervisor's loop (not started) has not seen it
        before = time.monotonic()
        assert supervisor.kill_learner(0, repair_s=0.5)
        restart_at = supervisor.children["learner_0"].restart_at
        assert restart_at is not None and restart_at - before <= 0.5 + 1.0  # not 30 s
        supervisor.poll()  # not a death of its own now: no crash, no backoff
        lines = log.path.read_text().splitlines() if log.path.exists() else []
        assert not [x for x in lines if '"crash"' in x], lines
        assert supervisor.children["learner_0"].restart_at == restart_at
    finally:
        supervisor.stop()
        procs.reap()
