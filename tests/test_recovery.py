"""Recovery: durable syncer commits, learner and syncer restarts, syncer shards.

The single-process tests drive a real syncer over gRPC on 127.0.0.1 with real Orbax commits.
The multi-process ones start syncer and learner processes themselves (the test is the process
manager), kill them with SIGKILL, start the same command again, wait on step counts and
versions with generous deadlines, and reap every process even when they fail.
"""

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.config import write_config_file
from decoupled_diloco.local.evaluator import GlobalEvaluator
from decoupled_diloco.local.procs import free_port
from decoupled_diloco.syncer.server import SyncerServer
from decoupled_diloco.tasks import make_task
from tests.conftest import tiny_config
from tests.helpers import ROOT, is_due, wait_until

STEPS = 150  # per learner, in the multi-process runs

TOKEN = "recovery-test-token"


def _config(**overrides):
    base = {
        "decoupled.fragments": 2,
        "decoupled.quorum": 2,
        "decoupled.syncer.max_grace_s": 0.0,
        "outer.merge": "rda",
    }
    return tiny_config(mode="decoupled", **{**base, **overrides})


def _push(client, server, fragment, learner, rnd, seed):
    specs = server.state.fragments[fragment].specs
    rng = np.random.default_rng(seed)
    arrays = [(1e-2 * rng.standard_normal(s.shape)).astype(s.dtype) for s in specs]
    return client.push(
        learner_id=learner,
        fragment=fragment,
        round=rnd,
        base_version=0,
        steps=4,
        tokens=1024,
        specs=specs,
        arrays=arrays,
    )


def _server(config, directory):
    return SyncerServer(
        config, host="127.0.0.1", port=0, token=TOKEN, checkpoint_dir=str(directory)
    ).start()


def test_restarted_syncer_resumes_its_commits_and_counts_a_retried_push_once(tmp_path):
    config = _config()
    server = _server(config, tmp_path)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    try:
        for learner in (0, 1):
            client.register(learner, server.fingerprint)
        assert _push(client, server, 1, 0, 0, seed=1).accepted
        assert _push(client, server, 1, 1, 0, seed=2).accepted  # quorum 2: merged
        version, merged = client.pull(0, 1, 1, wait_s=30)  # published once committed
        assert version == 1
        assert _push(client, server, 0, 0, 0, seed=3).accepted  # pending (quorum 2)
        assert server.committer.syncs >= 1
        pending_delta = server.state.pending_gradient(0, 0)
    finally:
        client.close()
        server.stop(0)  # no final commit: everything acknowledged is on disk already

    again = _server(config, tmp_path)
    client = SyncerClient(f"127.0.0.1:{again.port}", config.decoupled.syncer, TOKEN)
    try:
        assert again.restored_step is not None
        assert again.state.versions() == [0, 1]
        _, values = client.pull(0, 1, 1, wait_s=30)
        for got, want in zip(values, merged, strict=True):
            np.testing.assert_array_equal(got, want)
        status = client.status()
        assert status["fragments"][0]["pending"] == [0]
        for got, want in zip(again.state.pending_gradient(0, 0), pending_delta, strict=True):
            np.testing.assert_array_equal(got, want)
        retried = _push(client, again, 0, 0, 0, seed=3)  # its reply was "lost": sent again
        assert retried.duplicate
        assert client.status()["fragments"][0]["pending"] == [0]
        assert _push(client, again, 0, 1, 0, seed=4).accepted  # completes the quorum
        version, _ = client.pull(1, 0, 1, wait_s=30)
        assert version == 1
        assert [e["learners"] for e in again.state.merge_log] == [[0, 1], [0, 1]]
    finally:
        client.close()
        again.stop(0)


@contextlib.contextmanager
def _tmpfs(path):
    """A real 4 MB tmpfs mounted at `path` (skips the test where mounting is not allowed)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A small disk at tmp_path/"pushes", where the syncer keeps its push store."""
    with _tmpfs(tmp_path / "pushes") as store:
        yield store


def test_a_write_ahead_log_on_a_full_disk_stops_the_syncer_and_acknowledges_nothing(tmp_path):
    """The log on a real, filled tmpfs: the push whose record cannot be written is refused
    (UNAVAILABLE), nothing after it is published, the server stops serving; restarted once
    space frees, it resumes from the log with every acknowledged version."""
    config = _config(**{"decoupled.quorum": 1, "decoupled.syncer.retries": 0})

    def push(client, server, rnd):
        specs = server.state.fragments[1].specs
        rng = np.random.default_rng(rnd)
        arrays = [(1e-3 * rng.standard_normal(s.shape)).astype(s.dtype) for s in specs]
        return client.push(
            learner_id=0,
            fragment=1,
            round=rnd,
            base_version=server.state.versions()[1],
            steps=4,
            tokens=1024,
            specs=specs,
            arrays=arrays,
        )

    with _tmpfs(tmp_path / "wal") as log_dir:
        server = _server(config, tmp_path)
        client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
        acknowledged = 0
        try:
            client.register(0, server.fingerprint)
            free = os.statvfs(log_dir).f_bavail * os.statvfs(log_dir).f_frsize
            (log_dir / "filler").write_bytes(b"\0" * free)
            with pytest.raises(grpc.RpcError) as refused:  # (the log's last page fills first)
                for rnd in range(200):
                    assert push(client, server, rnd).accepted
                    acknowledged = client.pull(0, 1, rnd + 1, wait_s=30)[0]
                    assert acknowledged == rnd + 1
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "write-ahead log failed" in refused.value.details()
            assert server.state.wal_failed and server.state.versions()[1] == acknowledged

            def stopped():
                try:
                    client.status()
                except grpc.RpcError:
                    return True
                return False

            wait_until(stopped, 30, "the server to stop serving")
        finally:
            client.close()
            server.stop(0)
        (log_dir / "filler").unlink()
        again = _server(config, tmp_path)
        try:
            client = SyncerClient(f"127.0.0.1:{again.port}", config.decoupled.syncer, TOKEN)
            # Every acknowledged version is back; the refused push was never acknowledged (it
            # may be merged now if its own record made it to the log before the cut).
            # Settled: no round open, and its last merge published (on its log's disk sync,
            # after the round closed: read before, the version was one behind).
            fragment = again.state.fragments[1]
            settled = wait_until(
                lambda: fragment.round is None and fragment.published == fragment.version,
                30,
                "rounds",
            )
            assert settled and again.state.versions()[1] in (acknowledged, acknowledged + 1)
            rnd = again.state.versions()[1]
            assert push(client, again, rnd + 1).accepted
            assert client.pull(0, 1, rnd + 1, wait_s=30)[0] == rnd + 1
            client.close()
        finally:
            again.stop(0)


def test_a_full_disk_refuses_a_push_retryably_and_loses_nothing(tmp_path, small_disk):
    """The push store on a real tmpfs, filled up: the push is refused with RESOURCE_EXHAUSTED
    (retryable, naming the store), nothing is pending and no file is left; once space frees,
    the same push is accepted and merged."""
    store = small_disk
    config = _config(**{"decoupled.quorum": 1, "decoupled.syncer.retries": 0})
    server = client = None
    try:
        server = _server(config, tmp_path)
        client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
        client.register(0, server.fingerprint)
        size = sum(s.nbytes for s in server.state.fragments[0].specs)
        free = os.statvfs(store).f_bavail * os.statvfs(store).f_frsize
        assert size > 16 << 10 and free > size  # (a push of this model fits when empty)
        filler = store / "filler"
        filler.write_bytes(b"\0" * (free - size // 2))
        with pytest.raises(grpc.RpcError) as refused:
            _push(client, server, 0, 0, 0, seed=1)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "cannot store this push" in refused.value.details()
        assert str(store) in refused.value.details()
        assert server.state.fragments[0].pending == {} and server.state.versions() == [0, 0]
        assert sorted(p.name for p in store.iterdir()) == ["filler"]
        filler.unlink()
        assert _push(client, server, 0, 0, 0, seed=1).accepted
        assert client.pull(0, 0, 1, wait_s=30)[0] == 1
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop(0)


def test_a_log_record_cut_by_a_full_disk_leaves_the_log_readable(small_disk):
    from decoupled_diloco.syncer import wal

    log = wal.WriteAheadLog(small_disk / "0.log")
    big = np.ones(256 << 10, np.float32)  # 1 MB a record: the 4 MB disk fills within five
    written = 0
    with pytest.raises(OSError):
        for seq in range(1, 10):
            log.append({"seq": seq}, [big])
            written = seq
    log.append({"seq": written + 1}, [])  # a small one still fits, after the cut-off one
    log.close()
    seqs = [header["seq"] for header, _ in wal.read(small_disk / "0.log")]
    assert 2 <= written < 9 and seqs == [*range(1, written + 1), written + 1]


def test_corrupt_syncer_snapshot_falls_back_with_a_warning_and_the_log_loses_nothing(
    tmp_path, caplog
):
    config = _config(**{"decoupled.quorum": 1, "decoupled.syncer.snapshot_s": 0.0})
    server = _server(config, tmp_path)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    snapshots = server.committer.checkpointer
    try:
        client.register(0, server.fingerprint)
        assert _push(client, server, 0, 0, 0, seed=1).accepted
        assert client.pull(0, 0, 1, wait_s=30)[0] == 1
        committer = server.committer  # (its own thread uses the Orbax manager meanwhile)
        wait_until(lambda: committer.snapshot_seq == server.state.seq, 30, "a snapshot")
        previous = committer.snapshot_seq
        assert _push(client, server, 1, 0, 0, seed=2).accepted
        assert client.pull(0, 1, 1, wait_s=30)[0] == 1
        wait_until(lambda: committer.snapshot_seq > previous, 30, "a newer snapshot")
    finally:
        client.close()
        server.stop(0)
    newest = snapshots.all_steps()[-1]
    damaged = 0
    for path in (tmp_path / "snapshots" / str(newest) / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage" * 7)
            damaged += 1
    assert damaged
    logs = sorted((tmp_path / "wal").glob("*.log"), key=lambda p: int(p.stem))
    with logs[-1].open("ab") as log:  # a record cut short by a crash
        log.write(b"DDW1\x05\x00")
    with caplog.at_level(logging.WARNING):
        again = _server(config, tmp_path)
    try:
        assert f"syncer checkpoint {tmp_path}/snapshots/{newest} is unreadable" in caplog.text
        assert "falling back" in caplog.text and "cut short by a crash" in caplog.text
        # The previous snapshot plus the write-ahead logs since it: nothing lost.
        assert again.state.versions() == [1, 1] and again.committer.replayed >= 1
        client = SyncerClient(f"127.0.0.1:{again.port}", config.decoupled.syncer, TOKEN)
        assert _push(client, again, 1, 0, 0, seed=2).duplicate  # its key survived too
        assert _push(client, again, 1, 0, 5, seed=3).accepted
        assert client.pull(0, 1, 2, wait_s=30)[0] == 2
        client.close()
    finally:
        again.stop(0)
    with pytest.raises(ValueError, match="owns"):
        SyncerServer(
            _config(**{"decoupled.syncer.shards": 2}),
            port=0,
            token=TOKEN,
            shard=1,
            checkpoint_dir=str(tmp_path),
        )


def test_outbox_folds_what_a_newer_push_contains_and_bounds_the_rest():
    from decoupled_diloco.learner.outbox import Outbox
    from decoupled_diloco.learner.schedule import reschedule

    box = Outbox(num_fragments=2, bound=2)
    first = box.add(0, base=3, steps=8, tokens=100, foldable=True)
    second = box.add(0, base=3, steps=8, tokens=100, foldable=True)  # contains `first`
    assert first.superseded and (second.steps, second.tokens) == (16, 200)
    assert box.deliver(first, lambda: pytest.fail("a folded push is never sent"), None) is None
    other_anchor = box.add(0, base=4, steps=8, tokens=100, foldable=True)
    assert not second.superseded and box.unsent() == 2
    coded = box.add(0, base=4, steps=8, tokens=100, foldable=False)  # bound 2: drops `second`
    assert second.dropped and not other_anchor.dropped and box.dropped == 1
    coded.attempting = True  # one mid-attempt may be delivered: never folded nor dropped
    box.add(0, base=4, steps=8, tokens=100, foldable=True)
    box.add(0, base=4, steps=8, tokens=100, foldable=True)
    assert not coded.dropped and not coded.superseded
    assert box.pending[1] == [] and box.folded == 3 and len(box.pending[0]) == 2
    # A push that was attempted may have reached the syncer (its reply lost): it is folded (not
    # sent again: its progress is in the newer push) but its counts stay behind (the syncer
    # may hold them already; counted twice they would overweight it).
    fresh = Outbox(num_fragments=1, bound=4)
    sent = fresh.add(0, base=0, steps=8, tokens=100, foldable=True)
    assert fresh.deliver(sent, lambda: "reply", threading.Event()) == "reply" and sent.tried
    waiting = fresh.add(0, base=0, steps=8, tokens=100, foldable=True)
    waiting.tried = True  # as `deliver` leaves it between two attempts
    newer = fresh.add(0, base=0, steps=8, tokens=100, foldable=True)
    assert waiting.superseded and (newer.steps, newer.tokens) == (8, 100)
    # A restarted learner's schedule: the staggered rule from its restored step on.
    for step in range(40):
        assert reschedule(step, 3, 8) == [
            min(s for s in range(step + 1, step + 9) if is_due(s, p, 3, 8)) for p in range(3)
        ]


def test_shard_and_outage_settings_are_checked_with_the_field_named():
    from decoupled_diloco.comm.shards import syncer_client

    with pytest.raises(config_lib.ConfigError, match="decoupled.syncer.shards"):
        _config(**{"decoupled.syncer.shards": 3})  # 2 fragments
    with pytest.raises(config_lib.ConfigError, match="decoupled.syncer.max_unsent"):
        _config(**{"decoupled.syncer.max_unsent": 0})
    sharded = _config(**{"decoupled.syncer.shards": 2}).decoupled.syncer
    with pytest.raises(ValueError, match="one HOST:PORT per shard"):
        syncer_client("127.0.0.1:1", sharded, TOKEN)
    client = syncer_client(" 127.0.0.1:1, 127.0.0.1:2 ", sharded, TOKEN)
    assert [c.address for c in client.clients] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert [client.shard_of(p) for p in range(4)] == [0, 1, 0, 1]
    client.close()


# Multi-process ------------------------------------------------------------------------------


class Cluster:
    """Syncer shard and learner processes that this test starts, kills and restarts itself."""

    def __init__(self, workdir, config):
        self.workdir, self.config = workdir, config
        self.config_file = write_config_file(config, workdir / "config.py")
        shards = config.decoupled.syncer.shards
        self.ports = [free_port() for _ in range(shards)]
        self.address = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.procs = {}
        self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.env["DD_RUN_TOKEN"] = TOKEN
        (workdir / "logs").mkdir()

    def _start(self, name, args, env=None):
        with (self.workdir / "logs" / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", *args, f"--config={self.config_file}"],
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.procs[name]

    def start_syncer(self, shard=0, extra=()):
        """Starts (or restarts) syncer shard `shard` on its fixed port (`extra`: more flags)."""
        return self._start(
            f"syncer_{shard}",
            [
                "decoupled_diloco.syncer",
                "--host=127.0.0.1",
                f"--port={self.ports[shard]}",
                f"--shard={shard}",
                f"--port_file={self.workdir}/syncer_{shard}.port",
                f"--checkpoint_dir={self.workdir}/checkpoints/syncer_{shard}",
                *extra,
            ],
        )

    def start_learner(self, i):
        """Starts (or restarts) learner i: the very same command every time."""
        return self._start(
            f"learner_{i}",
            [
                "decoupled_diloco.learner",
                f"--syncer={self.address}",
                f"--learner_id={i}",
                f"--summary={self.workdir}/learner_{i}.json",
                f"--workdir={self.workdir}",
            ],
        )

    def kill(self, name):
        """SIGKILL, then reap."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def position(self, i):
        """Batches learner i has drawn, from its data journal."""
        path = self.workdir / "checkpoints" / f"learner_{i}.progress"
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text.isdigit() else 0

    def client(self, shard=0, timeout_s=5.0):
        syncer = dataclasses.replace(self.config.decoupled.syncer, rpc_timeout_s=timeout_s)
        return SyncerClient(f"127.0.0.1:{self.ports[shard]}", syncer, TOKEN)

    def versions(self, shard=0):
        """The shard's fragment versions, or None while it does not answer."""
        client = self.client(shard)
        try:
            request = pb.StatusRequest()
            reply = client.stub.Status(request, timeout=3, metadata=client.metadata)
            fragments = json.loads(reply.json)["fragments"]
        except grpc.RpcError:
            return None
        finally:
            client.close()
        return [f["version"] if f.get("owned", True) else None for f in fragments]

    def finish(self, timeout_s=240):
        """Waits for every learner to exit; returns their summaries."""
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            if name.startswith("learner"):
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
                assert proc.returncode == 0, self.log(name)[-3000:]
        m = self.config.num_learners
        return [json.loads((self.workdir / f"learner_{i}.json").read_text()) for i in range(m)]

    def log(self, name):
        return (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")

    def eval_loss(self):
        from decoupled_diloco.comm.shards import syncer_client

        client = syncer_client(self.address, self.config.decoupled.syncer, TOKEN)
        try:
            return GlobalEvaluator(self.config, client, None)()[1]
        finally:
            client.close()

    def reap(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _run_config(**overrides):
    base = tiny_config(
        mode="decoupled",
        train_steps=STEPS,
        inner_steps=8,
        log_every=50,
        **{
            "checkpoint.every": 20,
            "eval.every": 0,
            "decoupled.fragments": 2,
            "decoupled.quorum": 1,
            # A learner that finishes while the syncer is down waits 2 x this for it.
            "decoupled.syncer.rpc_timeout_s": 60.0,
            "outer.merge": "rda",
            # The repo's tiny_lm outer setting (plain averaging): with Nesterov 0.9 / lr 0.7,
            # the outer gradients a long outage accumulates overshoot (see docs/DESIGN.md).
            "outer.lr": 1.0,
            "outer.momentum": 0.0,
            "outer.nesterov": False,
        },
    )
    return config_lib.replace(base, **overrides) if overrides else base


@pytest.mark.multiprocess
def test_learner_killed_mid_run_restores_rejoins_and_neither_replays_nor_hides_data(tmp_path):
    # Static shards (the data journal's rule); leases: tests/test_elastic.py.
    cluster = Cluster(tmp_path, _run_config(**{"decoupled.data_shards": 0}))
    try:
        cluster.start_syncer()
        for i in range(2):
            cluster.start_learner(i)
        wait_until(lambda: cluster.position(1) >= 60, 180, "learner 1 to pass two checkpoints")
        cluster.kill("learner_1")
        drawn = cluster.position(1)  # what the dead process had drawn
        survivor = cluster.position(0)
        wait_until(lambda: cluster.position(0) >= survivor + 20, 120, "learner 0 to keep stepping")
        assert cluster.position(1) == drawn  # really down meanwhile
        before = wait_until(cluster.versions, 30, "the syncer's versions")
        cluster.start_learner(1)  # the same command, under whatever process manager
        summaries = cluster.finish()
        log = cluster.log("learner_1")
        joined = [int(v) for v in re.findall(r"joined at versions \[(.*?)\]", log)[-1].split(",")]
        assert all(j >= b for j, b in zip(joined, before, strict=True)), (joined, before)
        first, again = summaries
        assert first["steps"] == again["steps"] == STEPS and not first["errors"] + again["errors"]
        assert first["restarts"] == 0 and again["restarts"] == 1
        restored = again["restored_from_step"]
        assert 0 < restored <= drawn and restored % 20 == 0, (restored, drawn)
        # The data rule: resumed after the last batch the dead process drew; the batches of
        # its lost steps were skipped, counted and logged, not trained on again.
        assert again["skipped_batches"] == again["lost_steps"] == drawn - restored
        assert again["data_position"] == STEPS + drawn - restored == cluster.position(1)
        assert f"{drawn - restored} batches drawn after it were skipped" in log
        assert (
            again["tokens"]
            == first["tokens"]
            == STEPS * make_task(cluster.config).tokens_per_step(cluster.config.data.batch_size)
        )
        assert cluster.eval_loss() < 4.5  # ln(256) = 5.55 at init
    finally:
        cluster.reap()


@pytest.mark.multiprocess
def test_syncer_killed_in_the_middle_of_a_merge_loses_no_acknowledged_version(tmp_path):
    # One learner, slowed down 6x so that it is still training while the syncer is away (a
    # loaded machine may take seconds to notice the pause: the learner must outlast that).
    # Static shards: its data journal shows it stepping (leases: tests/test_elastic.py).
    slow = {"slow_learner": 0, "slowdown": 6.0, "decoupled.data_shards": 0}
    cluster = Cluster(tmp_path, _run_config(num_learners=1, **slow))
    marker = tmp_path / "paused_in_merge"
    try:
        cluster.start_syncer(extra=[f"--debug_pause_in_merge=4:{marker}"])
        cluster.start_learner(0)
        seen = []

        def paused():
            if marker.exists():
                return True
            versions = cluster.versions()
            if versions is not None and not marker.exists():
                seen.append(versions)
            return False

        wait_until(paused, 180, "the syncer to stop inside its 4th merge")
        before = seen[-1] if seen else [0, 0]  # published (acknowledged) before the pause
        cluster.kill("syncer_0")
        position = cluster.position(0)
        wait_until(
            lambda: cluster.position(0) >= position + 15,
            120,
            "the learner to keep stepping while the syncer is down",
        )
        cluster.start_syncer()
        after = wait_until(cluster.versions, 120, "the restarted syncer")
        assert all(a >= b for a, b in zip(after, before, strict=True)), (after, before)
        # The restarted syncer answers as soon as it serves, a moment before it prints its line.
        started = wait_until(
            lambda: cluster.log("syncer_0").count("listening on") == 2 and cluster.log("syncer_0"),
            60,
            "the restarted syncer's start line",
        )
        restart_line = [x for x in started.splitlines() if "listening on" in x][-1]
        assert "resumed from commit" in restart_line, started
        summaries = cluster.finish()
        assert all(x["steps"] == STEPS and not x["errors"] for x in summaries), summaries
        assert sum(x["retries"] for x in summaries) > 0  # pushes waited out the outage
        final = wait_until(cluster.versions, 30, "the final versions")
        assert sum(final) > sum(after)  # merges went on after the restart
        assert cluster.eval_loss() < 4.5
    finally:
        cluster.reap()


@pytest.mark.multiprocess
def test_with_two_shards_killing_one_leaves_the_other_shards_fragments_advancing(tmp_path):
    config = _run_config(
        num_learners=1, slow_learner=0, slowdown=3.0, **{"decoupled.syncer.shards": 2}
    )
    cluster = Cluster(tmp_path, config)
    try:
        for shard in range(2):
            cluster.start_syncer(shard)
        cluster.start_learner(0)
        wait_until(lambda: (cluster.versions(1) or [0, 0])[1] >= 2, 180, "shard 1 to merge")
        cluster.kill("syncer_1")
        down = wait_until(cluster.versions, 30, "shard 0")[0]
        wait_until(
            lambda: (cluster.versions(0) or [-1])[0] >= down + 4,
            120,
            "shard 0's fragment to advance",
        )
        assert cluster.versions(1) is None and cluster.procs["syncer_1"].poll() is not None
        cluster.start_syncer(1)  # from its own checkpoint
        assert wait_until(lambda: cluster.versions(1), 120, "shard 1 back")[1] >= 2
        summaries = cluster.finish()
        assert all(x["steps"] == STEPS and not x["errors"] for x in summaries), summaries
        assert cluster.eval_loss() < 4.5
    finally:
        cluster.reap()
