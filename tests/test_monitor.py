"""Operating a run: the syncer's Prometheus metrics over real HTTP, the token, the job page."""

import http.client
import json
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decoupled_diloco.comm import auth
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.obs import page
from decoupled_diloco.obs.http import HttpServer, same_secret
from decoupled_diloco.obs.monitor import Monitor, write_targets
from decoupled_diloco.syncer.metrics import serve_metrics
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config
from tests.helpers import wait_until

TOKEN = "monitor-test-token"
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def base_name(name: str) -> str:
    """A sample's family name: without the `_total`, `_count`, `_sum`, ... suffixes."""
    return re.sub(r"_(total|count|sum|bucket|created)$", "", name)


def documented_names() -> set[str]:
    """Metric family names in docs/operations.md's tables (`dd_...` in backticks)."""
    return {base_name(n) for n in re.findall(r"`(dd_[a-z_]+)`", DOCS.read_text())}


def scrape(url: str, secret: str | None = TOKEN) -> dict[str, dict]:
    """family name -> {labels tuple: value} of one scrape (samples named as exposed)."""
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _status_code(url: str, headers: dict | None = None) -> int:
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture
def syncer():
    config = tiny_config(
        mode="decoupled",
        **{"decoupled.fragments": 2, "decoupled.quorum": 2, "decoupled.syncer.max_grace_s": 0.0},
    )
    server = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    metrics = serve_metrics(server)
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    yield server, client, metrics
    client.close()
    metrics.stop()
    server.stop(0)


def _push(server, client, learner, rnd=0):
    specs = server.state.fragments[0].specs
    arrays = [np.full(s.shape, 1e-3, np.float32) for s in specs]
    return client.push(
        learner_id=learner, fragment=0, round=rnd, base_version=0, steps=4, tokens=1024,
        specs=specs, arrays=arrays,
    )  # fmt: skip


def test_syncer_metrics_move_with_pushes_and_merges_and_are_documented(syncer):
    server, client, metrics = syncer
    url = metrics.url("/metrics")
    for i in (0, 1):
        client.register(i, server.fingerprint, "1x1")
        client.heartbeat(learner_id=i, step=10 + i, loss=2.5, state="training", versions=[0, 0])
    before = scrape(url)
    assert before["dd_syncer_merges_total"][(("fragment", "0"), ("shard", "0"))] == 0
    assert before["dd_syncer_learner_step"][(("learner", "1"), ("shard", "0"))] == 11
    _push(server, client, 0)
    _push(server, client, 1)
    wait_until(lambda: server.state.fragments[0].published == 1, 30, "the merge")
    after = scrape(url)
    key = (("fragment", "0"), ("shard", "0"))
    assert after["dd_syncer_merges_total"][key] == 1
    assert after["dd_syncer_fragment_version"][key] == 1
    accepted = (("fragment", "0"), ("outcome", "accepted"), ("shard", "0"))
    assert after["dd_syncer_pushes_total"][accepted] == 2
    assert after["dd_syncer_received_bytes_total"][(("shard", "0"),)] > 0
    assert after["dd_syncer_merge_size_pushes_count"][(("shard", "0"),)] == 1
    assert after["dd_syncer_merge_size_pushes_sum"][(("shard", "0"),)] == 2
    assert after["dd_syncer_merge_seconds_count"][(("shard", "0"),)] == 1
    assert after["dd_syncer_learners"][(("shard", "0"), ("status", "live"))] == 2
    # A push of learner 1's credential as learner 0: refused, and counted by its code.
    other = SyncerClient(
        f"127.0.0.1:{server.port}", server.state.config.decoupled.syncer,
        auth.learner_credential(TOKEN, 1),
    )  # fmt: skip
    with pytest.raises(Exception, match="PERMISSION_DENIED|cannot act"):
        other.heartbeat(learner_id=0, step=1, loss=1.0, state="training", versions=[0, 0])
    other.close()
    refused = scrape(url)["dd_syncer_refused_requests_total"]
    assert refused[(("code", "permission_denied"), ("shard", "0"))] == 1
    # Every family the syncer exposes is documented (histograms by their base name).
    exposed = {base_name(n) for n in after}
    assert exposed <= documented_names(), exposed - documented_names()


def test_metrics_refuse_requests_without_the_token(syncer):
    server, _, metrics = syncer
    url = metrics.url("/metrics")
    assert _status_code(url) == 401
    assert _status_code(url, {"Authorization": "Bearer wrong"}) == 401
    assert _status_code(url, {"Cookie": "dd_token=wrong"}) == 401
    assert _status_code(url, {"Authorization": f"Bearer {TOKEN}"}) == 200
    # The run's metrics-only secret, and any secret the syncer accepts (a learner's credential).
    scrape = auth.scrape_secret(TOKEN)
    assert _status_code(url, {"Authorization": f"Bearer {scrape}"}) == 200
    credential = auth.learner_credential(TOKEN, 0)
    assert _status_code(url, {"Authorization": f"Bearer {credential}"}) == 200
    # The scrape secret grants nothing over gRPC.
    reader = SyncerClient(f"127.0.0.1:{server.port}", server.state.config.decoupled.syncer, scrape)
    with pytest.raises(Exception, match="UNAUTHENTICATED|wrong run token"):
        reader.status()
    reader.close()
    assert _status_code(metrics.url("/metrics?" + "&".join("a" * 9)), {}) == 400
    assert _status_code(metrics.url("/nothing"), {"Authorization": f"Bearer {TOKEN}"}) == 404
    connection = http.client.HTTPConnection("127.0.0.1", metrics.port, timeout=10)
    connection.request("POST", "/metrics", body=b"x", headers={"Authorization": f"Bearer {TOKEN}"})
    assert connection.getresponse().status == 405
    connection.close()


def test_a_browser_trades_the_token_in_the_url_for_a_cookie():
    scrape = auth.scrape_secret(TOKEN)
    check = lambda s: same_secret(TOKEN)(s) or same_secret(scrape)(s)  # noqa: E731
    server = HttpServer(check, {"/": _hello}, cookie_secret=scrape).start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", "/?token=wrong")
        assert connection.getresponse().status == 401
        connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", f"//elsewhere.example/%0d%0aX-Bad:%201?token={TOKEN}")
        reply = connection.getresponse()
        assert reply.status == 303 and reply.getheader("Location") == "/"  # never elsewhere
        assert reply.getheader("X-Bad") is None
        cookie = reply.getheader("Set-Cookie")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        # The cookie holds the metrics-only secret, never the run token; named after the port.
        assert cookie.startswith(f"dd_token_{server.port}={scrape};") and TOKEN not in cookie
        connection.close()
        assert _status_code(server.url("/"), {"Cookie": cookie.split(";")[0]}) == 200
        other_port = f"dd_token_{server.port + 1}={scrape}"
        assert _status_code(server.url("/"), {"Cookie": other_port}) == 401
    finally:
        server.stop()


def test_idle_connections_cannot_take_every_thread():
    server = HttpServer(same_secret(TOKEN), {"/": _hello}, max_connections=2).start()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        # Both slots are held by connections that send nothing: a third is closed at once.
        wait_until(lambda: server._server.slots._value == 0, 10, "the idle connections")
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            _status_code(server.url("/"), {"Authorization": f"Bearer {TOKEN}"})
        for sock in idle:
            sock.close()
        wait_until(lambda: server._server.slots._value == 2, 20, "slots freed by closed sockets")
        assert _status_code(server.url("/"), {"Authorization": f"Bearer {TOKEN}"}) == 200
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_connection_is_cut_at_its_deadline_whatever_it_sends():
    server = HttpServer(same_secret(TOKEN), {"/": _hello}, deadline_s=1.0).start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.send(b"GET / HTTP/1.1\r\n")
        lines, closed = 0, False
        while lines < 60 and not closed:  # a header line every 0.2 s, never the blank line
            try:
                sock.send(b"X-Trickle: 1\r\n")
                lines += 1
                if select.select([sock], [], [], 0.2)[0]:
                    data = sock.recv(1024)
                    assert data == b"", data  # cut, not answered
                    closed = True
            except OSError:  # reset or broken pipe: cut
                closed = True
        # Cut by the 1 s deadline (~5-10 lines), long before the 100-header limit would.
        assert closed and lines < 50, lines
    finally:
        sock.close()
        server.stop()


def _hello(environ, start_response):
    del environ
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


def _status(step, loss, state="training", mesh="1x1", merges=0, uptime=10.0):
    return {
        "learners": {
            "0": {"state": state, "mesh": mesh, "step": step, "loss": loss, "staleness": 1,
                  "heartbeat_age_s": 0.5, "versions": [1, 2], "incarnation": 0},
        },
        "fragments": [{"version": 1, "merges": merges, "pending": [], "late_pushes": 0,
                       "duplicate_pushes": 0, "refused_merges": 0, "bytes": 4096}],
        "merges": merges,
        "uptime_s": uptime,
        "ema": {},
    }  # fmt: skip


def test_page_shows_learners_loss_states_and_faults_from_the_run_directory(tmp_path):
    (tmp_path / "timeline").mkdir()
    lines = [
        {"t": 100.0, "state": "starting", "learners": [0], "step": -1},
        {"t": 101.0, "state": "compiling", "learners": [0], "step": 1},
        {"t": 102.0, "state": "stepping", "learners": [0], "step": 2},
    ]
    (tmp_path / "timeline" / "learner_0.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"t": 103.0, "sta'  # a cut last line
    )
    events = [
        {"time": 102.5, "event": "fault", "kind": "kill", "learner": 0},
        {"step": 8, "eval_loss": 3.25},
        # The launcher's progress line: the curve from the run's start, for a late page.
        {"step": 3, "learner_ids": [0], "learner_steps": [3], "learner_losses": [4.5]},
        {"time": 104.0, "event": "recovery", "kind": "restart", "process": "learner_0"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    history = page.JobHistory(tmp_path, title="a <b>run</b>")
    history.add(_status(5, 4.0), now=105.0)
    history.add(_status(9, 3.5, mesh="<script>alert(1)</script>", merges=3, uptime=20.0), 106.0)
    body = page.render_body(history, now=106.0)
    assert "<script>" not in body and "&lt;script&gt;" in body  # a hostile learner's text
    assert "a &lt;b&gt;run&lt;/b&gt;" in body
    assert '<span class="step">9</span>' in body and "3.5000" in body
    assert history.losses["0"][:3] == [(3, 4.5), (5, 4.0), (9, 3.5)]
    assert history.state_of("0") == "stepping"  # the timeline's state, not the heartbeat's
    assert body.count("<polyline") == 1 and 'class="eval"' in body
    assert 'class="fault"' in body and 'class="recovery"' in body
    assert "merges/min" in body
    # The cut line is read once it is complete; nothing is read twice.
    with (tmp_path / "timeline" / "learner_0.jsonl").open("a") as f:
        f.write('te": "blocked", "learners": [0], "step": 9}\n')
    history.add(_status(10, 3.4, merges=3, uptime=22.0), now=107.0)
    assert [s for _, s in history.spans["0"]] == ["starting", "compiling", "stepping", "blocked"]
    assert len(history.events) == 2 and history.evals == [(8, 3.25)]
    # Another file (the supervisor's) names the learner too: states stay in time order.
    down = {"t": 101.5, "state": "down", "learners": [0], "step": -1}
    (tmp_path / "timeline" / "supervisor.jsonl").write_text(json.dumps(down) + "\n")
    history.add(_status(11, 3.3, merges=3, uptime=23.0), now=108.0)
    assert [s for _, s in history.spans["0"]][1:4] == ["compiling", "down", "stepping"]
    assert [t for t, _ in history.spans["0"]] == sorted(t for t, _ in history.spans["0"])
    document = page.page(history)
    assert document.startswith("<!doctype html>")
    assert "://" not in document and not re.search(r"\b(src|href)=", document)  # self-contained


def test_loss_history_stays_bounded_and_keeps_its_start():
    history = page.JobHistory()
    for step in range(1, 5001):
        history.add(_status(step, 10.0 / step), now=float(step))
    points = history.losses["0"]
    assert len(points) <= page.MAX_POINTS and points[0][0] == 1 and points[-1][0] == 5000


def test_monitor_serves_the_page_and_its_json_behind_the_token(syncer, tmp_path):
    server, client, metrics = syncer
    (tmp_path / f"syncer{'.metrics.port'}").write_text(str(metrics.port))
    client.register(0, server.fingerprint, "1x1")
    client.heartbeat(learner_id=0, step=7, loss=2.0, state="training", versions=[0, 0])
    scrape = auth.scrape_secret(TOKEN)
    monitor = Monitor(client, TOKEN, workdir=tmp_path, refresh_s=0.1, scrape_secret=scrape).start()
    try:
        assert _status_code(monitor.url()) == 401
        # A learner's credential reads the syncer, not the operator's page.
        credential = auth.learner_credential(TOKEN, 0)
        assert _status_code(monitor.url(), {"Authorization": f"Bearer {credential}"}) == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert _status_code(monitor.url(), {"Authorization": f"Bearer {scrape}"}) == 200
        request = urllib.request.Request(monitor.url(), headers=bearer)
        with urllib.request.urlopen(request, timeout=30) as r:
            assert "script-src 'unsafe-inline'" in r.getheader("Content-Security-Policy")
            assert '<span class="step">7</span>' in r.read().decode()
        client.heartbeat(learner_id=0, step=8, loss=1.9, state="training", versions=[0, 0])
        api = monitor.server.url("/api/status")

        def step() -> int:
            with urllib.request.urlopen(
                urllib.request.Request(api, headers=bearer), timeout=30
            ) as r:
                return json.loads(r.read())["status"]["learners"]["0"]["step"]

        wait_until(lambda: step() == 8, 30, "the next poll")
        targets = json.loads((tmp_path / "prometheus_targets.json").read_text())
        assert targets == [
            {"targets": [f"127.0.0.1:{metrics.port}"], "labels": {"process": "syncer"}}
        ]
        assert write_targets(tmp_path) == targets
    finally:
        monitor.stop()


@pytest.mark.multiprocess
def test_status_serve_runs_the_page_until_sigterm(syncer, tmp_path):
    server, client, _ = syncer
    client.register(0, server.fingerprint, "1x1")
    client.heartbeat(learner_id=0, step=31, loss=2.0, state="training", versions=[0, 0])
    # What the local launcher leaves in its workdir for `status --workdir`.
    (tmp_path / "syncer.port").write_text(str(server.port))
    (tmp_path / "run_token").write_text(TOKEN)
    command = [sys.executable, "-m", "decoupled_diloco.status", f"--workdir={tmp_path}"]
    command += ["--serve=0", "--interval=0.2"]
    env = {k: v for k, v in os.environ.items() if k != "DD_RUN_TOKEN"}
    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watchdog = threading.Timer(120, proc.kill)  # bounds the read below
    watchdog.start()
    try:
        seen = ""
        for line in proc.stdout:  # until the line naming the page (the watchdog bounds it)
            seen += line
            url = re.search(r"job page at (http://\S+)", line)
            if url:
                break
        assert url, seen
        page_url = url.group(1).split("?")[0]
        assert _status_code(page_url) == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        with urllib.request.urlopen(
            urllib.request.Request(page_url, headers=bearer), timeout=30
        ) as r:
            assert '<span class="step">31</span>' in r.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
