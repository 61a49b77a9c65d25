"""Elastic membership and the data ledger: leases, coverage, joins, deaths, restarts.

The pure tests drive `syncer.ledger.Ledger` and a `SyncerState`; the durable one restarts a
real syncer over gRPC with its write-ahead log; the multi-process one is a whole run whose
learners and syncer this test starts, SIGKILLs and starts again itself, and whose ledger must
show every window of the budget consumed exactly once.
"""

import json
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.chaos import faults
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.syncer.ledger import Ledger, split
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config
from tests.helpers import popen_logged, tail, wait_until
from tests.test_recovery import TOKEN, Cluster, _run_config


def test_the_budget_is_cut_into_leases_of_equal_length():
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(3, 64) == [1, 1, 1]  # fewer batches than shards: one batch each
    assert sum(split(300, 16)) == 300


def _covered_all(ledger, learner, fragments):
    """Grants and merges every lease `learner` can get, fragment by fragment."""
    while (grant := ledger.grant(learner, {learner}, False, [[]] * fragments)).status == "granted":
        for p in range(fragments):
            ledger.record_merge(p, [[grant.lease, grant.begin, grant.end]])


def test_a_dead_learners_lease_is_handed_again_from_what_every_fragment_holds():
    ledger = Ledger(total_batches=40, shards=4, num_fragments=2, batch_size=8)
    first = ledger.grant(0, {0, 1}, False, [[], []])
    assert (first.status, first.lease, first.begin, first.end) == ("granted", 0, 0, 10)
    # Learner 0 pushed fragment 0 up to batch 6 (merged) and fragment 1 up to 3 (pending).
    ledger.record_merge(0, [[0, 0, 6]])
    pending = [[], [[0, 0, 3]]]
    # Alive: its lease is its own; the others' go to learner 1.
    assert ledger.grant(1, {0, 1}, False, pending).lease == 1
    # Dead (not among the live): handed again before any fresh lease, from batch 3, with
    # fragment 0 told that it holds up to 6 already.
    again = ledger.grant(1, {1}, False, pending)
    assert (again.lease, again.begin, again.end, again.covered) == (0, 3, 10, [6, 3])
    report = ledger.report(pending)
    assert report["missing_pending"] == 3 * 8  # fragment 1's first 3 batches: not merged yet
    assert report["leases_handed_again"] == 1


def test_the_report_counts_windows_missing_and_repeated_per_fragment():
    ledger = Ledger(total_batches=6, shards=2, num_fragments=2, batch_size=4)
    _covered_all(ledger, 0, 2)
    assert ledger.report()["consumed_once"] == ledger.report()["windows"] == 24
    ledger.record_merge(1, [[1, 0, 2]])  # fragment 1 merged lease 1's first 2 batches twice
    report = ledger.report()
    assert report["repeated"] == 2 * 4 and report["missing"] == 0
    assert report["consumed_once"] == 4 * 4
    fresh = Ledger(total_batches=6, shards=2, num_fragments=2, batch_size=4)
    fresh.grant(0, {0}, False, [[], []])
    fresh.record_merge(0, [[0, 0, 3]])
    report = fresh.report()
    assert report["missing"] == 6 * 4  # fragment 1 holds nothing; lease 1 nobody trained
    assert report["missing_ranges"][0] == {
        "lease": 0, "begin": 0, "end": 3, "fragments": [1], "holder": 0, "handed": 1,
    }  # fmt: skip


def test_a_ledger_snapshot_holds_its_state_as_of_the_call_and_a_replay_counts_once():
    # The syncer writes a snapshot after letting go of its lock; changes made meanwhile are
    # in the write-ahead log after the snapshot's seq, and a restore replays them. Were they
    # in the snapshot too, a replayed merge would count its batches twice (seen in CI: a
    # syncer killed during a merge, `repeated` 48 windows).
    ledger = Ledger(total_batches=8, shards=2, num_fragments=2, batch_size=4)
    ledger.grant(0, {0, 1}, False, [[], []])
    ledger.record_merge(0, [[0, 0, 2]])
    saved = ledger.to_json()
    as_of_the_call = json.dumps(saved)
    ledger.record_merge(0, [[0, 2, 3]])  # after the snapshot: in the log only
    ledger.grant(1, {0, 1}, False, [[], []])
    assert json.dumps(saved) == as_of_the_call
    restored = Ledger(total_batches=8, shards=2, num_fragments=2, batch_size=4)
    restored.load(json.loads(as_of_the_call))
    restored.record_merge(0, [[0, 2, 3]])  # the log's replay
    restored.take(1, 1)
    assert restored.report() == ledger.report()
    assert restored.report()["repeated"] == 0


def test_a_flushed_learner_gets_its_own_hole_back_and_the_run_ends_when_all_is_covered():
    ledger = Ledger(total_batches=4, shards=1, num_fragments=1, batch_size=1)
    assert ledger.grant(0, {0}, False, [[]]).lease == 0
    ledger.record_merge(0, [[0, 0, 2]])  # its push of batches 2-3 was refused (late)
    assert ledger.grant(0, {0}, False, [[]]).status == "wait"  # it may still push them
    back = ledger.grant(0, {0}, True, [[]])  # flushed: the hole is its to train again
    assert (back.status, back.begin) == ("granted", 2)
    ledger.record_merge(0, [[0, 2, 4]])
    assert ledger.grant(0, {0}, True, [[]]).status == "done"


def test_a_lease_whose_pushes_never_cover_it_is_given_up_after_max_grants():
    # Behind a link too slow for its push schedule every push of a hole came back late: the
    # hole was handed back to its flushed learner without end. Now at most `max_grants` times.
    ledger = Ledger(total_batches=4, shards=2, num_fragments=1, batch_size=2, max_grants=3)
    grants = [ledger.grant(0, {0}, True, [[]]).lease for _ in range(4)]
    assert grants == [0, 0, 0, 1]  # lease 0 three times (its pushes always refused), then 1
    assert ledger.grant(1, {0, 1}, False, [[]]).status == "wait"  # learner 0 holds lease 1
    ledger.record_merge(0, [[1, 0, 2]])  # and covers it
    assert ledger.grant(0, {0, 1}, True, [[]]).status == "done"
    report = ledger.report()
    assert (report["missing"], report["leases_given_up"]) == (2 * 2, 1)
    assert report["missing_ranges"][0] == {
        "lease": 0, "begin": 0, "end": 2, "fragments": [0], "holder": 0, "handed": 3,
    }  # fmt: skip


def test_pushes_must_name_leases_their_learner_was_handed_and_count_their_steps():
    from decoupled_diloco.syncer import elastic
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = tiny_config(mode="decoupled", train_steps=20, **{"decoupled.data_shards": 4})
    state = SyncerState(config, *initial_fragments(config))
    state.register(0, "1x1")
    assert elastic.lease(state, 0, False).lease == 0
    assert elastic.check_data(state, 0, 3, [[0, 0, 3]]) is None
    assert "never handed" in elastic.check_data(state, 0, 3, [[1, 0, 3]])
    assert "steps=2" in elastic.check_data(state, 0, 2, [[0, 0, 3]])
    assert "outside" in elastic.check_data(state, 0, 30, [[0, 0, 30]])
    # One push never counts a batch twice (a learner that trained its batches again).
    overlap = elastic.check_data(state, 0, 5, [[0, 0, 3], [0, 1, 3]])
    assert "overlap: [1, 3) of lease 0" in overlap
    # A constant global batch counts units of rows: a step trains 1 .. 2 x 8 of them (all of
    # the 2 starting learners' batch, 8 rows each, when one learner is left).
    config = config_lib.replace(config, **{"decoupled.global_batch": "constant"})
    state = SyncerState(config, *initial_fragments(config))
    state.register(0, "1x1")
    assert elastic.lease(state, 0, False).end == 2 * 20 * 8 // 4
    assert elastic.check_data(state, 0, 3, [[0, 0, 3]]) is None
    assert elastic.check_data(state, 0, 3, [[0, 0, 40]]) is None
    assert "steps=3 train 3..48" in elastic.check_data(state, 0, 3, [[0, 0, 2]])
    assert "steps=2 train 2..32" in elastic.check_data(state, 0, 2, [[0, 0, 40]])


def test_a_constant_global_batch_is_split_by_the_live_learners_in_whole_units():
    config = tiny_config(
        mode="decoupled",
        num_learners=4,
        **{"data.batch_size": 16, "decoupled.global_batch": "constant"},
    )
    assert config_lib.lease_unit(config) == 1  # 1x1 meshes: a row
    assert config_lib.budget_units(config) == 4 * 8 * 16
    # 64 rows a step in all: 16 each of 4, 11 each of 6 (66), 21 each of 3 (63).
    assert [config_lib.units_per_step(config, n) for n in (4, 6, 3, 1, 100)] == [16, 11, 21, 64, 1]
    two = config_lib.replace(config, **{"decoupled.mesh_shapes": "2x1,1x1,1x1,1x1"})
    assert config_lib.lease_unit(two) == 2 and config_lib.units_per_step(two, 6) == 5
    odd = config_lib.replace(two, **{"decoupled.lease_unit": 1})
    with pytest.raises(config_lib.ConfigError, match=r"lease_unit.*data-parallel size \[1, 2\]"):
        config_lib.lease_unit(odd)
    with pytest.raises(config_lib.ConfigError, match="decoupled.lease_unit"):
        config_lib.validate(config_lib.replace(config, **{"decoupled.lease_unit": 3}))
    with pytest.raises(config_lib.ConfigError, match="decoupled.global_batch"):
        config_lib.validate(config_lib.replace(config, **{"decoupled.global_batch": "fixed"}))
    per_learner = config_lib.replace(config, **{"decoupled.global_batch": "per_learner"})
    assert config_lib.lease_unit(per_learner) == 16
    assert [config_lib.units_per_step(per_learner, n) for n in (1, 4, 6)] == [1, 1, 1]


def test_leased_steps_end_at_lease_ends_and_at_positions_a_fragment_covers():
    import threading

    from decoupled_diloco.learner import leases
    from decoupled_diloco.syncer.ledger import Grant

    class Data:
        def train_iterator(self, batch_size, lease, shards, seed):
            rows = np.arange(100 * batch_size).reshape(100, batch_size) + 1000 * lease
            return iter(rows[:, :, None])  # units of (batch_size, 1) rows

    # Lease 3 handed again from unit 2, one fragment covering it to 7, the other to 2; then
    # lease 5 whole.
    grants = iter([Grant("granted", 3, 2, 12, 8, [7, 2]), Grant("granted", 5, 0, 6, 8, [0, 0])])
    per_step = iter([4, 4, 4, 4, 4, 2, 2, 2])
    steps = list(
        leases.leased_batches(
            Data(), 2, 0, lambda flushed: next(grants, Grant("done")), lambda grant: None,
            lambda: True, threading.Event(), ahead=False, units_per_step=lambda: next(per_step),
        )
    )  # fmt: skip
    assert [where for _, where in steps] == [
        [[3, 2, 6]], [[3, 6, 7]], [[3, 7, 11]], [[3, 11, 12]], [[5, 0, 4]], [[5, 4, 6]],
    ]  # fmt: skip
    first, _ = steps[0]
    assert first.shape == (8, 1)  # 4 units of 2 rows, in the shard's order
    np.testing.assert_array_equal(first[:, 0], 3000 + np.arange(4, 12))


def test_a_slow_learner_keeps_its_lease_and_data_handed_again_is_never_merged_twice():
    from decoupled_diloco.syncer import elastic
    from decoupled_diloco.syncer.records import Push
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = tiny_config(
        mode="decoupled",
        train_steps=20,
        **{"decoupled.data_shards": 4, "decoupled.fragments": 1, "decoupled.quorum": 2},
    )
    now = [0.0]
    state = SyncerState(config, *initial_fragments(config), clock=lambda: now[0])
    timeout = config.decoupled.syncer.learner_timeout_s
    state.register(0, "1x1")
    state.register(1, "1x1")
    # Both spent longer than the timeout building and compiling before their first lease
    # (seen on a GPU: 50 s): the first to ask is alive by asking, and keeps its lease.
    now[0] = timeout + 10
    assert elastic.lease(state, 0, False).lease == 0
    now[0] += 1
    assert elastic.lease(state, 1, False).lease == 1
    # Learner 0 then goes silent past the timeout: its lease is handed to learner 1 ...
    now[0] += timeout + 1
    state.heartbeat(1, step=0, tokens=0, loss=0.0, state="training", versions=[0])
    again = elastic.lease(state, 1, False)
    assert (again.lease, again.begin) == (0, 0)
    zeros = [np.zeros(s.shape, s.dtype) for s in state.fragments[0].specs]

    def push(learner, round_, data):
        steps = sum(e - b for _, b, e in data)
        return state.push(Push(learner, 0, round_, 0, steps, steps * 8 * 32, zeros, data=data))

    assert push(1, 0, [[0, 0, 3]]).accepted

    # ... but learner 0 was only slow: its push of the same batches is refused, named, and
    # the state is as it was; its batches nobody else holds are taken.
    def held():
        pending = sorted(state.fragments[0].pending)
        return state.versions(), [list(r) for r in state.ledger.merged[0]], pending

    before = held()
    refused = push(0, 0, [[0, 1, 4]])
    assert not refused.accepted and refused.reason.startswith("covered")
    assert "[1, 3) of lease 0" in refused.reason
    assert held() == before
    assert push(0, 1, [[0, 4, 6]]).accepted
    report = state.ledger.report(elastic.pending_ranges(state))
    assert report["repeated"] == 0


def _syncer(config, directory):
    return SyncerServer(
        config, host="127.0.0.1", port=0, token=TOKEN, checkpoint_dir=str(directory)
    ).start()


def test_a_restarted_syncer_keeps_its_ledger_and_hands_no_lease_twice(tmp_path):
    config = tiny_config(
        mode="decoupled",
        train_steps=20,
        **{"decoupled.data_shards": 4, "decoupled.fragments": 1, "decoupled.quorum": 1},
    )
    server = _syncer(config, tmp_path)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    try:
        client.register(0, server.fingerprint)
        grant = client.lease(0)
        assert (grant.status, grant.lease, grant.begin, grant.end) == ("granted", 0, 0, 10)
        specs = server.state.fragments[0].specs
        arrays = [np.full(s.shape, 1e-3, s.dtype) for s in specs]
        reply = client.push(
            learner_id=0, fragment=0, round=0, base_version=0, steps=4, tokens=4 * 8 * 32,
            specs=specs, arrays=arrays, data=[[0, 0, 4]],
        )  # fmt: skip
        assert reply.accepted
        wait_until(lambda: server.state.versions()[0] == 1, 30, "the merge")
    finally:
        client.close()
        server.stop()
    server = _syncer(config, tmp_path)  # restored from its snapshot and log
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    try:
        status = client.status()
        assert status["data_ledger"]["consumed_once"] == 4 * 8
        client.register(1, server.fingerprint)
        assert client.lease(1).lease == 1  # lease 0 is learner 0's still (it counts as live)
        client.register(0, server.fingerprint)  # learner 0 restarted: its lease comes back
        again = client.lease(0)
        assert (again.lease, again.begin, list(again.covered)) == (0, 4, [4])
        # A push naming a lease its learner never held is refused before it is read.
        with pytest.raises(grpc.RpcError) as refused:
            client.push(
                learner_id=0, fragment=0, round=0, base_version=1, steps=2, tokens=2 * 8 * 32,
                specs=specs, arrays=arrays, data=[[3, 0, 2]], retries=0,
            )  # fmt: skip
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "never handed" in refused.value.details()
    finally:
        client.close()
        server.stop()


def _status(cluster):
    client = cluster.client()
    try:
        return client.status()
    except grpc.RpcError:
        return None
    finally:
        client.close()


def _learner(cluster, i, field):
    status = _status(cluster)
    entry = (status or {}).get("learners", {}).get(str(i))
    return entry[field] if entry else 0


@pytest.mark.multiprocess
def test_a_run_that_gains_and_loses_learners_consumes_every_window_exactly_once(
    tmp_path, prepared_stdlib
):
    """2 learners; one SIGKILLed mid-lease and restarted; a third joins; the syncer is killed
    and restarted; then learner 0 dies for good. Every window of the budget is in the global
    model exactly once, the joined learner's pushes are merged.

    The learners' steps are slowed through their live chaos controls while the joiner starts
    and until learner 0 dies, so the budget cannot run out first however loaded the machine is.
    The global batch is constant (the ledger counts rows; each step trains 16 rows over the
    live learners: leases handed again are cut inside steps' worth of units), the one path
    the other multi-process tests do not take. The data is a prepared corpus on disk (token
    shards, packed windows), which the other multi-process tests do not read either.
    """
    config = _run_config(
        **{
            "data.path": str(prepared_stdlib),
            "decoupled.global_batch": "constant",
            "decoupled.data_shards": 16,
            "decoupled.max_learners": 3,
            "decoupled.syncer.learner_timeout_s": 5.0,
            "decoupled.syncer.rpc_timeout_s": 20.0,
        }
    )
    cluster = Cluster(tmp_path, config)
    controls = tmp_path / "controls"
    cluster.env[faults.DIR_ENV] = str(controls)

    def slow(learners, factor):
        for i in learners:
            faults.write_controls(controls, i, {"slowdown": factor} if factor > 1 else {})

    try:
        cluster.start_syncer()
        for i in range(2):
            cluster.start_learner(i)
        wait_until(lambda: _learner(cluster, 1, "step") >= 30, 180, "learner 1 at step 30")
        slow([0, 1], 100)  # ~1 s a step while the joiner starts
        cluster.kill("learner_1")  # mid-lease (a lease is ~19 batches)
        cluster.start_learner(1)
        cluster.start_learner(2)  # an id beyond the starting learners: a join
        wait_until(lambda: _learner(cluster, 2, "pushes") >= 2, 180, "learner 2's pushes")
        slow([0, 1, 2], 20)
        before = _learner(cluster, 0, "step")
        cluster.kill("syncer_0")
        cluster.start_syncer()
        wait_until(
            lambda: _learner(cluster, 0, "step") >= before + 4, 180, "learner 0 after the restart"
        )
        cluster.kill("learner_0")  # for good: its lease goes to the others after the timeout
        slow([1, 2], 1)
        for i in (1, 2):
            cluster.procs[f"learner_{i}"].wait(timeout=240)
            assert cluster.procs[f"learner_{i}"].returncode == 0, cluster.log(f"learner_{i}")
        status = wait_until(lambda: _status(cluster), 30, "the syncer's status")
        ledger = status["data_ledger"]
        windows = config.num_learners * config.train_steps * config.data.batch_size
        assert ledger["windows"] == windows
        assert (ledger["consumed_once"], ledger["missing"], ledger["repeated"]) == (
            windows, 0, 0,
        ), (ledger, status["membership"])  # fmt: skip
        assert ledger["leases_handed_again"] >= 2  # learner 1's (killed) and learner 0's
        merged_from = {i for m in status["merge_log"] for i in m.get("learners", [])}
        assert 2 in merged_from, status["merge_log"][-3:]
        events = [(e["event"], e["learner"]) for e in status["membership"]]
        assert ("joined", 2) in events and ("restarted", 1) in events, events
        assert ("lost", 0) in events, events
        joined = json.loads((tmp_path / "learner_2.json").read_text())
        assert joined["data"] == "leases" and joined["leases_trained"]
        assert joined["pushes"]["accepted"] > 0
    finally:
        cluster.reap()


def test_data_settings_are_checked_with_the_field_named():
    with pytest.raises(config_lib.ConfigError, match="decoupled.max_learners"):
        config_lib.validate(tiny_config(mode="decoupled", **{"decoupled.max_learners": 1}))
    with pytest.raises(config_lib.ConfigError, match="decoupled.data_shards"):
        config_lib.validate(tiny_config(mode="decoupled", **{"decoupled.data_shards": -1}))


def _text(path):
    return path.read_text() if path.exists() else ""


def _events(run):
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if "event" in e]


@pytest.mark.multiprocess
def test_the_launcher_grows_and_shrinks_a_run_by_schedule_and_by_the_status_command(tmp_path):
    """2 learners; the schedule adds learner 2 and lets learner 0 leave; `status --add_learner`,
    run from outside, adds learner 3. The ledger is exact; the summary has all four."""
    from tests.test_chaos_multiprocess import ROOT, TINY

    schedule = tmp_path / "elastic.yaml"
    schedule.write_text(
        "seed: 0\nfaults:\n"
        # Learners 0-2 are slowed 1000x (seconds a step) until learner 3 steps, so that the
        # budget outlasts the joiners' start however loaded the machine is.
        + "".join(f"  - {{at_s: 0, kind: slow, learner: {i}, factor: 1000}}\n" for i in range(3))
        + "  - {at_step: 1, kind: join, learner: 2}\n"
        "  - {at_step: 3, kind: leave, learner: 0}\n"
    )
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DD_RUN_TOKEN"] = "elastic-test-token"
    args = [
        f"--workdir={run}", *TINY, f"--config.chaos={schedule}", "--config.mode=decoupled",
        "--config.train_steps=48", "--config.decoupled.data_shards=8",
        "--config.decoupled.max_learners=4",
    ]  # fmt: skip
    log = tmp_path / "launcher.log"
    proc = popen_logged(
        [sys.executable, "-m", "experiments.train", *args], log, cwd=ROOT, env=env,
        start_new_session=True,  # one process group: the cleanup reaches every child
    )  # fmt: skip
    try:
        wait_until(lambda: any(e["event"] == "membership" for e in _events(run)), 240, "the join")
        added = subprocess.run(
            [sys.executable, "-m", "decoupled_diloco.status", f"--workdir={run}", "--add_learner"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr[-2000:]
        stepping = lambda: '"stepping"' in _text(run / "timeline" / "learner_3.jsonl")  # noqa: E731
        wait_until(stepping, 240, "learner 3 stepping")
        for i in range(3):  # the end of the slow-down (the file the injector wrote)
            faults.write_controls(run / "chaos", i, {})
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = tail(log, 4000)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    ledger = summary["data_ledger"]
    assert ledger["windows"] == 2 * 48 * 8
    assert (ledger["consumed_once"], ledger["missing"], ledger["repeated"]) == (
        ledger["windows"], 0, 0,
    ), ledger  # fmt: skip
    changes = [(e["kind"], e["learner"], e.get("source", "chaos")) for e in _events(run)]
    assert ("join", 2, "chaos") in changes and ("leave", 0, "chaos") in changes, changes
    assert ("join", 3, "status") in changes, changes
    learners = {x["learner_id"]: x for x in summary["learners"]}
    assert sorted(learners) == [0, 1, 2, 3]
    # The leaver flushed what it trained: answered (merged, or refused as late: 1000x slower
    # than learner 3, its pushes may be too stale) and nothing left unsent.
    pushes = learners[0]["pushes"]
    assert learners[0]["left"] and pushes["accepted"] + pushes["late"] > 0
    assert learners[0]["pushes_unsent"] == 0 and not learners[0]["errors"]
    # The joiners trained to the end: none was ended with the thread that started it.
    assert not learners[2]["left"] and not learners[3]["left"]
    assert learners[3]["leases_trained"] and learners[3]["pushes"]["accepted"] > 0
    events = [(e["event"], e["learner"]) for e in summary["membership"]]
    assert ("joined", 2) in events and ("joined", 3) in events and ("left", 0) in events, events
    # Goodput is over the changing membership: every learner's allocated time is its own.
    timeline = summary["timeline"]["learners"]
    assert set(timeline) == {"0", "1", "2", "3"}, timeline.keys()
    assert 0 < summary["goodput"] <= 1


def test_join_and_leave_events_are_checked_against_the_learners_that_can_exist(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "faults:\n  - {at_step: 5, kind: join, learner: 2}\n"
        "  - {at_s: 9, kind: kill, learner: 2, repair_s: 1}\n"  # a joiner can fail too
        "  - {at_s: 20, kind: leave, learner: 0}\n"
    )
    schedule = faults.load(path, 2, max_learners=3)
    assert sorted(f.kind for f in schedule.faults) == ["join", "kill", "leave"]
    path.write_text("faults:\n  - {at_step: 5, kind: join, learner: 2}\n")
    with pytest.raises(faults.ChaosError, match=r"a join needs an id in \[2, 2\)"):
        faults.load(path, 2)  # max_learners defaults to num_learners: nobody can join
    path.write_text("faults:\n  - {at_s: 1, kind: kill, learner: 3}\n")
    with pytest.raises(faults.ChaosError, match="no learner 3 among 2"):
        faults.load(path, 2, max_learners=4)  # 3 could exist, but never joins
    path.write_text("faults:\n  - {at_s: 1, kind: join, learner: 1}\n")
    with pytest.raises(faults.ChaosError, match="a join needs an id"):
        faults.load(path, 2, max_learners=4)  # learner 1 trains from the start


def test_scale_requests_are_taken_once_in_order_and_bad_ones_are_named(tmp_path):
    from decoupled_diloco.local import scaling

    with pytest.raises(ValueError, match="no run_token"):
        scaling.request(tmp_path, "join")
    (tmp_path / "run_token").write_text("t")
    scaling.request(tmp_path, "join")
    scaling.request(tmp_path, "leave", 1)
    (tmp_path / "scale" / "99999999999999999999-0-join.json").write_text('{"action": "grow"}')
    with pytest.raises(ValueError, match="names the learner"):
        scaling.request(tmp_path, "leave")
    taken = scaling.take(tmp_path)
    assert taken[:2] == [{"action": "join", "learner": -1}, {"action": "leave", "learner": 1}]
    assert taken[2]["action"] == "invalid" and "grow" in taken[2]["error"]
    assert scaling.take(tmp_path) == []


def test_a_learner_says_it_has_flushed_only_once_its_pushes_are_delivered():
    # On a slow link the final flush's bounded wait ends while the last push still crosses:
    # asking "flushed" then would hand that lease's hole back to this learner, which would
    # train it again (its push then refused as covered). It says so only once delivered.
    import itertools
    import threading

    from decoupled_diloco.learner import leases
    from decoupled_diloco.syncer.ledger import Grant

    class Data:
        def train_iterator(self, batch_size, lease, shards, seed):
            return itertools.count()

    grants = iter([Grant("granted", 0, 0, 2, 1), Grant("wait"), Grant("wait"), Grant("wait")])
    asked, delivered = [], iter([False, False, True])
    stop = threading.Event()

    def ask(flushed):
        asked.append(flushed)
        return next(grants, Grant("done"))

    batches = leases.leased_batches(
        Data(), 1, 0, ask, lambda grant: None, lambda: next(delivered), stop, poll_s=0.0,
        ahead=False,
    )  # fmt: skip
    assert [where for _, where in batches] == [[[0, 0, 1]], [[0, 1, 2]]]
    assert asked == [False, False, False, False, True]


def test_a_single_process_learner_settles_its_pause_without_a_lease_call_per_poll():
    # Issue 22: behind a slow link a lease call waits seconds behind the push data, and each
    # step of a pause (a round trip ended: its fragment pushed) used to wait for one. With
    # `settle_s` the pause is polled between two asks until it settles.
    import itertools
    import threading

    from decoupled_diloco.learner import leases
    from decoupled_diloco.syncer.ledger import Grant

    class Data:
        def train_iterator(self, batch_size, lease, shards, seed):
            return itertools.count()

    grants = iter([Grant("granted", 0, 0, 1, 1), Grant("wait"), Grant("wait")])
    asked, polls = [], []

    def ask(flushed):
        asked.append((flushed, len(polls)))
        return next(grants, Grant("done"))

    def on_idle():
        polls.append(None)
        return len(polls) == 3  # settled at the third poll

    batches = leases.leased_batches(
        Data(), 1, 0, ask, lambda grant: None, on_idle, threading.Event(), poll_s=0.0,
        ahead=False, settle_s=60.0,
    )  # fmt: skip
    assert [where for _, where in batches] == [[[0, 0, 1]]]
    # Asked for the first lease, then "wait" (no poll yet): three polls, no ask between them.
    assert asked == [(False, 0), (False, 0), (True, 3), (True, 3)]
    # A pause that does not settle within `settle_s` lets the learner ask again.
    grants = iter([Grant("wait"), Grant("wait")])
    asked, polls = [], []
    batches = leases.leased_batches(
        Data(), 1, 0, ask, lambda grant: None, lambda: polls.append(None) or False,
        threading.Event(), poll_s=0.0, ahead=False, settle_s=0.05,
    )  # fmt: skip
    assert list(batches) == []
    assert [flushed for flushed, _ in asked] == [False, False, False] and len(polls) >= 2
