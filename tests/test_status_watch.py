"""`python -m decoupled_diloco.status --watch`: the live table against a real syncer."""

import os
import socket
import subprocess
import sys

import pytest
from rich.console import Console

from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.obs import watch
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config
from tests.helpers import ROOT

pytestmark = pytest.mark.multiprocess  # starts real processes

TOKEN = "watch-test-token"


def _text(renderable) -> str:
    console = Console(width=140, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_watch_refreshes_learners_fragments_and_merge_rate(tmp_path):
    config = tiny_config(mode="decoupled", **{"decoupled.fragments": 2})
    server = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    # What the local launcher leaves in its workdir for `status --workdir`.
    (tmp_path / "syncer.port").write_text(str(server.port))
    (tmp_path / "run_token").write_text(TOKEN)
    try:
        client.register(1, server.fingerprint, "1x1")
        client.heartbeat(learner_id=1, step=42, loss=2.25, state="training", versions=[0, 0])
        command = [sys.executable, "-m", "decoupled_diloco.status"]
        command += [f"--workdir={tmp_path}", "--watch", "--count=2", "--interval=0.1"]
        env = {k: v for k, v in os.environ.items() if k != "DD_RUN_TOKEN"}
        env["COLUMNS"] = "140"
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:
        client.close()
        server.stop(0)
    assert out.returncode == 0, out.stderr
    assert "training" in out.stdout and "42" in out.stdout and "2.250" in out.stdout
    assert "merges 0" in out.stdout and "0.0/min" in out.stdout and "syncer up" in out.stdout


def test_merge_rate_over_the_last_minute_and_across_restarts():
    rate = watch.MergeRate(window_s=60)
    assert rate.update({"uptime_s": 30.0, "merges": 10}) == 20.0  # since start
    assert rate.update({"uptime_s": 60.0, "merges": 40}) == 60.0  # (40 - 10) / 30 s
    assert rate.update({"uptime_s": 150.0, "merges": 40}) == 0.0  # nothing in the last minute
    assert rate.update({"uptime_s": 6.0, "merges": 3}) == 30.0  # restarted: from zero again
    assert rate.update({"merges": 3}) is None  # an old syncer without uptime


def test_render_shows_goodput_when_the_syncer_reports_it():
    status = {
        "learners": {"0": {"state": "recovering", "step": 5, "loss": float("nan")}},
        "fragments": [{"version": 3, "merges": 3, "pending": [0], "bytes": 1234}],
        "merges": 3,
        "goodput": {"goodput": 0.9, "uptime": 0.95},
    }
    text = _text(watch.render(status, merges_per_min=1.5))
    assert "recovering" in text and "1,234" in text and "1.5/min" in text
    assert "goodput: goodput 0.900, uptime 0.950" in text
    assert "goodput" not in _text(watch.render({**status, "goodput": None}))


def test_syncer_on_a_port_in_use_says_what_to_do():
    config = tiny_config(mode="decoupled")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}.*--port=0"):
            SyncerServer(config, host="127.0.0.1", port=port, token=TOKEN)


def test_the_live_table_the_status_table_and_the_progress_line_show_membership():
    from decoupled_diloco.local.poll import progress_line
    from decoupled_diloco.status import format_status

    learner = {
        "state": "training", "mesh": "1x1", "step": 7, "loss": 2.0, "eval_loss": float("nan"),
        "heartbeat_age_s": 0.1, "staleness": 0, "versions": [1],
    }  # fmt: skip
    status = {
        "learners": {"0": learner, "2": learner},
        "fragments": [{"version": 1, "merges": 1, "late_pushes": 0, "duplicate_pushes": 0,
                       "pending": [], "bytes": 10}],
        "merges": 1,
        "ema": {"step_s": 0.01, "quorum_s": 0.0, "sync_s": 0.0},
        "membership": [
            {"event": "joined", "learner": 2, "live": [0, 1, 2]},
            {"event": "left", "learner": 1, "live": [0, 2]},
        ],
        "data_ledger": {"windows": 400, "consumed_once": 100},
    }  # fmt: skip
    assert "membership: L2 joined, L1 left" in _text(watch.render(status))
    table = format_status(status)
    assert "learner 2 joined (live [0, 1, 2])" in table and "learner 1 left" in table
    line = progress_line(status, 0, 3.0)
    assert "L2 train 7 loss" in line and line.endswith("data 25%")
