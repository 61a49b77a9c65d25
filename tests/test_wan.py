"""A WAN on one machine (`local.wan`): namespaces, veth pairs and `tc tbf`, built and removed.

Real kernel shaping, measured from inside the namespaces; skipped with the reason where root,
iproute2 or the `tbf` qdisc is missing. Plus the scaling rule's arithmetic.
"""

import re
import subprocess
import sys
import threading
import time

import pytest

from decoupled_diloco.chaos import faults
from decoupled_diloco.local import wan
from decoupled_diloco.sim.bandwidth import PAPER_12B, Workload, scaled_bandwidth
from tests.helpers import assert_budget_trained_once

OK, WHY = wan.available()
needs_lab = pytest.mark.skipif(not OK, reason=f"no kernel shaping here: {WHY}")

# A receiver in one namespace: counts bytes from the first to the last, prints the rate.
_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(60)
got, t0 = 0, None
while True:
    data = c.recv(1 << 16)
    if not data:
        break
    t0 = t0 or time.perf_counter()
    got += len(data)
print(got, time.perf_counter() - t0, flush=True)
"""
_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def test_available_says_why_not():
    ok, why = wan.available(ip="/nonexistent/ip")
    assert not ok and ("not root" in why or "/nonexistent/ip" in why), why


def test_scaling_rule_against_a_hand_computation():
    # 12B, H=100, 1 s steps over 2 Gbit/s, scaled to 0.5M parameters, H=50, 0.2 s steps:
    # 2e9 * (0.5e6 / 12e9) * (100 * 1.0) / (50 * 0.2) = 2e9 * 4.1667e-5 * 10 = 833,333 bit/s.
    tiny = Workload(params=0.5e6, inner_steps=50, step_time_s=0.2)
    by_hand = 2e9 * 0.5e6 / 12e9 * 10
    assert scaled_bandwidth(2e9, PAPER_12B, tiny) == pytest.approx(by_hand, rel=1e-12)
    # The ratio N·b/(B·H·s) is the same on both sides (b equal).
    b_tiny = scaled_bandwidth(5e9, PAPER_12B, tiny)
    paper_ratio = PAPER_12B.params / (5e9 * PAPER_12B.inner_steps * PAPER_12B.step_time_s)
    tiny_ratio = tiny.params / (b_tiny * tiny.inner_steps * tiny.step_time_s)
    assert tiny_ratio == pytest.approx(paper_ratio)
    with pytest.raises(ValueError, match="step_time_s"):
        scaled_bandwidth(2e9, PAPER_12B, Workload(1e6, 50, 0.0))


def test_tbf_bucket_holds_a_segmentation_offloaded_packet():
    args = wan.tbf_args(8.0)
    assert args[:3] == ["tbf", "rate", "8000kbit"] and int(args[4]) >= 64 << 10


@needs_lab
def test_lab_builds_links_and_removes_everything_even_on_an_error():
    lab = wan.WanLab(2, rate_mbit=50.0, routed=True)
    with pytest.raises(RuntimeError, match="inside"), lab:
        spaces, links = lab.made()
        assert sorted(spaces) == sorted([lab.syncer_ns, *lab.site_ns])
        assert len(links) == 1  # the root namespace holds only the launcher's end
        qdisc = subprocess.run(
            ["ip", "netns", "exec", lab.site_ns[0], "tc", "qdisc", "show"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc and "rate 50Mbit" in qdisc
        # A learner reaches the syncer's namespace; the root namespace reaches it too.
        _transfer(lab.in_syncer, lambda c: lab.in_site(1, c), lab.syncer_address(1), 1000)
        _transfer(lab.in_syncer, lambda c: c, lab.syncer_address(), 1000)
        # Sites reach each other through the syncer's namespace (over both shaped links).
        _transfer(lambda c: lab.in_site(0, c), lambda c: lab.in_site(1, c), lab.site_address(0),
                  50_000)  # fmt: skip
        # ... but never the root namespace (which has no route back).
        probe = f"import socket; socket.create_connection(({lab.links[0].near_addr!r}, 9), 5)"
        cut = subprocess.run(lab.in_site(0, [sys.executable, "-c", probe]), capture_output=True,
                             text=True)  # fmt: skip
        assert cut.returncode != 0 and "Permission denied" in cut.stderr, cut.stderr
        up, down = lab.sent_bytes(1)
        assert up >= 51_000 and down > 0  # the kernel's count: site 1 sent both transfers
        assert lab.sent_bytes(0)[1] >= 50_000  # ... and the second one reached site 0
        # A site can have its own hostname: its address (gloo finds its own address by it).
        named = lab.in_site(1, ["hostname"], own_hostname=True)
        assert subprocess.run(
            named, capture_output=True, text=True, check=True
        ).stdout.strip() == lab.site_address(1)
        raise RuntimeError("an error inside the lab")
    assert lab.made() == ([], [])


def _transfer(receive_in, send_in, target: str, size: int) -> tuple[int, float]:
    """Sends `size` bytes to a receiver in another namespace: (bytes received, seconds)."""
    receiver = subprocess.Popen(
        receive_in([sys.executable, "-c", _RECEIVER]), stdout=subprocess.PIPE, text=True
    )
    try:
        port = receiver.stdout.readline().strip()
        sender = send_in([sys.executable, "-c", _SENDER, target, port, str(size)])
        subprocess.run(sender, check=True, timeout=120)
        got, seconds = receiver.communicate(timeout=120)[0].split()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(timeout=30)
    assert int(got) == size
    return int(got), float(seconds)


@needs_lab
@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_shaped_transfer_runs_at_the_configured_rate(direction):
    rate_mbit, size = 8.0, 3_000_000  # ~3 s at the rate; the 64 KiB bucket is 2% of it
    with wan.WanLab(1, rate_mbit=rate_mbit) as lab:
        # up: learner -> syncer (pushes); down: syncer -> learner (pulls).
        receive_in, send_in = (lab.in_syncer, lambda c: lab.in_site(0, c))
        target = lab.syncer_address(0)
        if direction == "down":
            receive_in, send_in = (lambda c: lab.in_site(0, c)), lab.in_syncer
            target = lab.links[1].far_addr
        _, seconds = _transfer(receive_in, send_in, target, size)
        measured_mbit = size * 8 / seconds / 1e6
        assert measured_mbit == pytest.approx(rate_mbit, rel=0.2), measured_mbit


@needs_lab
def test_an_island_spanning_sites_puts_each_process_in_a_site_of_its_own():
    with wan.WanLab(4, rate_mbit=None) as lab:
        shaping = wan.Shaping(lab, rate_mbit=5.0, island_processes=2, per_process=True)
        assert "each island process" in shaping.line
        # Learner 1's processes 0 and 1 are sites 2 and 3; its coordinator is at site 2.
        assert shaping.learner(1, ["x"], 1)[:4] == ["ip", "netns", "exec", lab.site_ns[3]]
        assert "unshare" in shaping.learner(1, ["x"], 1)  # (own hostname, for gloo)
        assert shaping.coordinator_host(1) == lab.site_address(2)
        assert shaping.address([7], 1, 1) == f"{lab.syncer_address(3)}:7"
        per_learner = wan.Shaping(lab, rate_mbit=5.0, island_processes=2)
        assert per_learner.learner(1, ["x"], 1)[:4] == ["ip", "netns", "exec", lab.site_ns[1]]
        assert per_learner.coordinator_host(1) == "127.0.0.1"


def test_wan_sites_are_checked_and_an_island_spanning_sites_is_never_paced(tmp_path, monkeypatch):
    from decoupled_diloco import config as config_lib

    base = config_lib.ExperimentConfig(mode="decoupled")
    with pytest.raises(config_lib.ConfigError, match="decoupled.wan_sites"):
        config_lib.replace(base, **{"decoupled.wan_sites": "rack"})
    with pytest.raises(config_lib.ConfigError, match="island_processes > 1"):
        config_lib.replace(base, **{"decoupled.wan_sites": "process", "decoupled.wan_mbit": 5.0})
    # A chunk must cross the link well within the streams' idle cut: named, with what fits.
    with pytest.raises(config_lib.ConfigError, match=r"chunk_bytes.*use at most 281250 bytes"):
        config_lib.replace(base, **{"decoupled.wan_mbit": 0.15})
    config_lib.replace(base, **{"decoupled.wan_mbit": 0.15, "decoupled.syncer.chunk_bytes": 65536})
    # A pull must be able to average what the link carries at all.
    with pytest.raises(config_lib.ConfigError, match=r"min_pull_bytes_per_s.*every pull would"):
        config_lib.replace(
            base, **{"decoupled.wan_mbit": 0.05, "decoupled.syncer.chunk_bytes": 16384}
        )
    monkeypatch.setattr(wan, "available", lambda *a, **k: (False, "not root (test)"))
    with pytest.raises(wan.WanError, match="cannot slow the island's own collectives"):
        wan.shaping_for(2.5, 1, str(tmp_path / "pacer"), island_processes=2, per_process=True)


def test_without_kernel_shaping_the_links_are_paced_in_process(tmp_path, monkeypatch):
    # Where the kernel cannot shape (no root, no tbf), the fallback: each learner's control
    # file caps its link, and its environment points it there.
    monkeypatch.setattr(wan, "available", lambda *a, **k: (False, "not root (test)"))
    shaping = wan.shaping_for(2.5, 2, str(tmp_path / "pacer"))
    assert shaping.kind == "pacer" and "paced in-process at 2.5 Mbit/s" in shaping.line
    assert "not root (test)" in shaping.line
    for i in (0, 1):
        assert faults.Controls(faults.control_path(tmp_path / "pacer", i)).get() == {
            "bandwidth_mbps": 2.5
        }
    assert shaping.env == {faults.DIR_ENV: str(tmp_path / "pacer")}
    assert shaping.learner(0, ["x"]) == ["x"] and shaping.address([5]) == "127.0.0.1:5"
    assert wan.shaping_for(0.0, 2, str(tmp_path / "none")).kind == "none"


@needs_lab
@pytest.mark.multiprocess
def test_a_decoupled_run_behind_the_kernel_limit_trains_and_leaves_nothing(
    tmp_path, corpus, capsys
):
    from decoupled_diloco.train import train_and_evaluate
    from tests.conftest import tiny_config

    config = tiny_config(
        mode="decoupled", train_steps=16, **{"decoupled.fragments": 2, "decoupled.wan_mbit": 4.0}
    )
    result = train_and_evaluate(config, tmp_path, corpus=corpus)
    s = result.summary
    assert s["steps_done"] == 16 and s["outer_syncs"] > 0 and s["bytes_sent"] > 0
    assert_budget_trained_once(s, learners=2)  # (learners train unequal shares of the leases)
    # The syncer was reached through the lab's links, not loopback.
    assert not (tmp_path / "syncer.address").read_text().startswith("127.")
    out = capsys.readouterr().out
    tag = re.search(r"network namespace \((dd\w+)\*\)", out).group(1)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in left and tag not in links  # every namespace and link it made is gone


def test_the_in_process_pacer_shares_one_budget_among_concurrent_calls(tmp_path):
    from decoupled_diloco.comm.faulty_link import DegradedLink

    faults.write_controls(tmp_path, 0, {"bandwidth_mbps": 8.0})
    link = DegradedLink(faults.Controls(faults.control_path(tmp_path, 0)), 0)
    values = link._values()
    chunk = 100_000  # 0.1 s each at 8 Mbit/s
    t0 = time.monotonic()
    threads = [
        threading.Thread(target=lambda: [link._pace(values, chunk, "up") for _ in range(3)])
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # Two calls of 0.3 s each on one 8 Mbit/s link: 0.6 s together, not 0.3 s side by side.
    assert time.monotonic() - t0 >= 0.55
    up = link._free_at["up"]
    link._pace(values, chunk, "down")  # the other direction has its own budget
    assert link._free_at["up"] == up and link._free_at["down"] > 0


@needs_lab
@pytest.mark.multiprocess
def test_dp_across_sites_sends_its_gradients_over_the_shaped_links(tmp_path, corpus, capsys):
    # One island of 2 processes, each in a site of its own: data-parallel over the WAN.
    from decoupled_diloco.train import train_and_evaluate
    from tests.conftest import tiny_config

    steps = 12
    config = tiny_config(
        mode="decoupled", num_learners=1, train_steps=steps, inner_steps=steps,
        **{"mesh.shape": (2, 1), "decoupled.island_processes": 2, "decoupled.fragments": 1,
           "decoupled.wan_sites": "process", "decoupled.wan_mbit": 20.0, "eval.every": 0},
    )  # fmt: skip
    s = train_and_evaluate(config, tmp_path, corpus=corpus).summary
    assert s["steps_done"] == steps and s["wan"]["shaping"] == "tbf"
    assert "each island process in its own network namespace" in capsys.readouterr().out
    # Site 1 never talks to the syncer (only the leader does): what its link carried is the
    # island's own collectives, at least one float32 gradient each way per step.
    site1 = s["wan"]["sites"][1]
    assert min(site1["up_bytes"], site1["down_bytes"]) >= steps * s["params"] * 4


def test_a_transfer_longer_than_the_rpc_deadline_arrives_and_a_stalled_one_is_cut(tmp_path):
    # A fragment that takes ~3 s on a slow link, with 1 s RPC deadlines: it moves all the
    # time, so it arrives (each way); a link too slow to move one chunk in 1 s is cut, retryably.
    import grpc

    from decoupled_diloco.comm import faulty_link, retry
    from decoupled_diloco.comm.client import Stalled, SyncerClient
    from decoupled_diloco.syncer.server import SyncerServer
    from tests.conftest import tiny_config

    config = tiny_config(mode="decoupled", **{
        "decoupled.fragments": 2, "decoupled.syncer.rpc_timeout_s": 1.0,
        "decoupled.syncer.chunk_bytes": 4096, "decoupled.syncer.max_grace_s": 0.0,
    })  # fmt: skip
    server = SyncerServer(config, host="127.0.0.1", port=0, token="t").start()
    faults.write_controls(tmp_path, 0, {"bandwidth_mbps": 0.1})
    link = faulty_link.DegradedLink(faults.Controls(faults.control_path(tmp_path, 0)), 0)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, "t", link=link)
    try:
        client.register(0, server.fingerprint)
        fragment = server.state.fragments[0]
        nbytes = sum(v.nbytes for v in fragment.values)
        assert nbytes * 8 / 0.1e6 > 2.0  # longer than the deadline, twice over
        t0 = time.monotonic()
        reply = client.push(
            learner_id=0, fragment=0, round=0, base_version=0, steps=4, tokens=1024,
            specs=fragment.specs, arrays=[v * 0 for v in fragment.values], retries=0,
        )  # fmt: skip
        assert reply.accepted and time.monotonic() - t0 > 2.0
        t0 = time.monotonic()
        version, values = client.pull(0, 0, 0, wait_s=0.0, retries=0)
        assert version >= 0 and sum(v.nbytes for v in values) == nbytes
        assert time.monotonic() - t0 > 2.0
        faults.write_controls(tmp_path, 0, {"bandwidth_mbps": 0.005})  # 6.5 s per chunk
        t0 = time.monotonic()
        with pytest.raises(Stalled, match="pull of fragment 0: nothing moved for 1 s") as cut:
            client.pull(0, 0, 0, wait_s=0.0, retries=0)
        # (cut after 1 s; the in-process pacer's sleep for the chunk ends first, the kernel's
        # link would not hold the call that long)
        assert time.monotonic() - t0 < 12.0 and retry.retryable(cut.value)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The paced push still loses its request or its reply as the link says (retryably).
        faults.write_controls(tmp_path, 0, {"seed": 0, "drop": 1.0})
        for _ in range(4):
            with pytest.raises(faulty_link.DroppedCall) as lost:
                client.push(
                    learner_id=0, fragment=1, round=0, base_version=0, steps=4, tokens=1024,
                    specs=server.state.fragments[1].specs, retries=0,
                    arrays=[v * 0 for v in server.state.fragments[1].values],
                )  # fmt: skip
            assert retry.retryable(lost.value)
        assert link.dropped["request"] > 0 and link.dropped["reply"] > 0
    finally:
        client.close()
        server.stop(0)


@needs_lab
def test_the_streams_tool_measures_streams_at_once_each_way():
    # tools/wan_streams.py (benchmarks/results/wan.md, "One transfer at a time", and the
    # planner's crossing efficiency), tiny: two calls one after another per stream, each way
    # alone and both ways at once.
    out = subprocess.run(
        [sys.executable, "-m", "tools.wan_streams", "--mbit=2", "--streams=2", "--chunks=8",
         "--chunk_bytes=16384", "--calls=2", "--duplex"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| p")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("pull", "2"), ("push", "2"), ("pull (beside pushes)", "2"), ("push (beside pulls)", "2")
    ], out  # fmt: skip
    for _, k, ended, share, gaps, errors in rows:
        assert errors.strip() == "-" and len(gaps.split(",")) == int(k)
        assert 0.1 < float(ended) < 60  # (the bucket passes 64 KiB at once; 256 KiB each)
        # 2 streams x 2 calls x 128 KiB over `ended` at 2 Mbit/s: the bucket's first burst
        # can put it over 1, never far.
        assert float(share) == pytest.approx(4 * 131072 * 8 / (float(ended) * 2e6), abs=0.01)
        assert 0.05 < float(share) < 2


class _HeldArray:
    """A lazy outer-gradient tensor (`wire.chunk_arrays`) whose bytes wait for `release`."""

    def __init__(self, values, release):
        self.values, self.release, self.nbytes = values, release, values.nbytes
        self.read = threading.Event()

    def le_bytes(self, start, stop):
        self.read.set()
        assert self.release.wait(60), "never released"
        return self.values.reshape(-1).view("u1")[start:stop].tobytes()


@pytest.mark.parametrize("transfers", [1, 0])
def test_a_learners_pushes_cross_its_data_connection_one_at_a_time(transfers):
    # Fragment 0's push is held mid-stream; fragment 1's, called meanwhile from another thread,
    # starts streaming only once fragment 0's is answered (`max_transfers` = 1, the default).
    # With no bound (0) it streams beside it: behind a slow link gRPC split the connection so
    # unevenly that streams stalled past the idle bounds (benchmarks/results/wan.md).
    from decoupled_diloco.comm.client import SyncerClient
    from decoupled_diloco.syncer.server import SyncerServer
    from tests.conftest import tiny_config

    config = tiny_config(mode="decoupled", **{
        "decoupled.fragments": 2, "decoupled.syncer.max_transfers": transfers,
        "decoupled.syncer.max_grace_s": 0.0,
    })  # fmt: skip
    server = SyncerServer(config, host="127.0.0.1", port=0, token="t").start()
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, "t")
    released, order = [threading.Event(), threading.Event()], []
    try:
        client.register(0, server.fingerprint)
        held = [
            [_HeldArray(v * 0, released[p]) for v in server.state.fragments[p].values]
            for p in (0, 1)
        ]

        def push(p):
            reply = client.push(
                learner_id=0, fragment=p, round=0, base_version=0, steps=1, tokens=1,
                specs=server.state.fragments[p].specs, arrays=held[p], retries=0,
            )  # fmt: skip
            order.append(("answered", p, reply.accepted))

        threads = [threading.Thread(target=push, args=(p,)) for p in (0, 1)]
        threads[0].start()
        assert held[0][0].read.wait(30)  # fragment 0 streams (and waits)
        threads[1].start()
        released[1].set()  # fragment 1 could stream at once
        # Waits for fragment 1's stream to start (no bound: it does) or 3 s (one at a time).
        order.append(("1 streamed while 0 was held", held[1][0].read.wait(3.0)))
        released[0].set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        overlapped = order[0] == ("1 streamed while 0 was held", True)
        assert overlapped == (transfers == 0), order
        assert sorted(x for x in order if x[0] == "answered") == [
            ("answered", 0, True), ("answered", 1, True)
        ]  # fmt: skip
    finally:
        for event in released:
            event.set()
        client.close()
        server.stop(0)


def _taken(total_chunks, buffered, chunk, rate):
    """(time, bytes) as gRPC takes a push's chunks: `buffered` at once, then at the link's pace."""
    marks, t = [], 0.0
    for i in range(total_chunks):
        t = 0.001 * i if i < buffered else t + chunk / rate
        marks.append((t, chunk * (i + 1)))
    return marks, t


@pytest.mark.parametrize("chunks", [34, 19])  # (19: gRPC's first burst is most of the push)
def test_a_pushs_reply_waits_for_what_is_still_queued_on_a_slow_link(chunks, monkeypatch):
    from decoupled_diloco.comm import client

    # 64 KiB chunks at 20 KB/s: gRPC buffers the first ~1.1 MB at once, then takes a chunk as
    # each one crosses; when it takes the last, what it buffered is still to cross.
    chunk, rate, buffered = 65536, 20_000, 17
    marks, t = _taken(chunks, buffered, chunk, rate)
    left = chunk * chunks - rate * t  # bytes not across yet when the last chunk was taken
    assert left > 0.9 * buffered * chunk
    assert client.queued_s(marks, t) == pytest.approx(left / rate, rel=0.01)
    # The watch: the cut after the last chunk comes `idle_s` after that (the checksum chunk
    # that ends every push is not a chunk of the link's pace).
    now = [0.0]
    monkeypatch.setattr(client.time, "monotonic", lambda: now[0])
    watch = client._Watch(idle_s=60.0)
    for when, _ in marks:
        now[0] = when
        watch.handed(chunk)
    watch.handed(8)  # the checksum
    watch.sent()
    assert watch._deadline == pytest.approx(t + 60.0 + left / rate, rel=0.01)


def test_a_push_taken_at_once_is_bounded_by_its_deadline_not_a_guess():
    from decoupled_diloco.comm import client

    marks, t = _taken(10, 10, 65536, 20_000)  # (the whole push fits gRPC's buffers)
    assert client.queued_s(marks, t) is None
    assert client.queued_s(marks[:1], t) is None
    watch = client._Watch(idle_s=60.0)
    for _ in range(10):
        watch.handed(65536)
    watch.handed(8)
    watch.sent()
    assert watch._deadline == float("inf")  # (the call's own deadline ends it)


def test_control_calls_have_a_connection_of_their_own(tmp_path):
    # On a slow link a fragment's bytes fill the data connection's queues for seconds or
    # minutes; heartbeats must not wait behind them: they go over a second TCP connection.
    from decoupled_diloco.comm.client import SyncerClient
    from decoupled_diloco.syncer.server import SyncerServer
    from tests.conftest import tiny_config

    config = tiny_config(mode="decoupled", **{"decoupled.fragments": 2})
    server = SyncerServer(config, host="127.0.0.1", port=0, token="t").start()
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, "t")
    try:
        client.register(0, server.fingerprint)
        client.heartbeat(learner_id=0, step=1, state="training")
        client.pull(0, 0, 0, wait_s=0.0)
        rows = []  # established (state 01) connections to the syncer, IPv4 or IPv6
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows += [line.split() for line in f.readlines()[1:]]
        port = f"{server.port:04X}"
        conns = {r[1] for r in rows if r[2].endswith(":" + port) and r[3] == "01"}
        assert len(conns) == 2, conns
    finally:
        client.close()
        server.stop(0)
