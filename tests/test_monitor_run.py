"""A real decoupled run with `monitor.enabled`: every process's /metrics, the page in Chromium.

The launcher is started as a user would (`python -m experiments.train ...`), scraped from
outside over HTTP and parsed with `prometheus_client`'s parser, and its page is loaded twice in
a real headless Chromium (installed from Debian's packages when missing; skipped, with the
reason, where that cannot be done). The run is stopped with SIGTERM, and every process it
started must be gone.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, wait_until
from tests.test_monitor import _status_code, base_name, documented_names, scrape

pytestmark = pytest.mark.multiprocess

SCREENSHOT = ROOT / "docs" / "img" / "monitor_page.png"  # refreshed with DD_UPDATE_DOCS=1


@pytest.fixture(scope="module")
def chromium():
    """A headless Chromium: found, or installed with apt-get (root), or the test is skipped."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("no chromium here, and it cannot be installed (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    log = ""
    for command in (install, ["apt-get", "update", "-q"], install):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(command)} took over 15 minutes")
        log = done.stdout[-500:] + done.stderr[-500:]
        if command is install and done.returncode == 0:
            break
    found = shutil.which("chromium")
    if not found:
        pytest.skip(f"apt-get could not install chromium: {log}")
    return found


def _browse(chromium: str, profile: pathlib.Path, url: str, *extra: str) -> str:
    command = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", f"--user-data-dir={profile}", "--window-size=1000,1250", *extra, url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _steps(dom: str) -> dict[str, int]:
    """learner -> step, from the page's learners table."""
    rows = re.findall(r"<tr><td>(\d+)</td><td><span class=\"state\"[^>]*>([a-z]+)</span>"
                      r"</td><td>[^<]*</td><td><span class=\"step\">(\d+)</span>", dom)  # fmt: skip
    return {learner: int(step) for learner, _, step in rows}


def _targets(workdir: pathlib.Path) -> dict[str, str]:
    path = workdir / "prometheus_targets.json"
    try:
        groups = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {g["labels"]["process"]: f"http://{g['targets'][0]}/metrics" for g in groups}


def _our_processes(workdir: pathlib.Path) -> list[int]:
    """Pids of live processes whose command line names the run's directory."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().split(") ")[1][0]
            except OSError:
                continue
            if str(workdir).encode() in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


def test_metrics_of_every_process_and_the_page_in_a_browser(tmp_path, chromium):
    workdir = tmp_path / "run"
    # Both learners 10x slower for the whole run: the test waits on events, not on speed, and a
    # tiny model's learners at full speed would take both cores from the rest of the suite.
    slow = tmp_path / "slow.yaml"
    slow.write_text(
        "seed: 0\nfaults:\n"
        + "".join(f"  - {{at_s: 0, kind: slow, learner: {i}, factor: 10}}\n" for i in (0, 1))
    )
    command = [
        sys.executable, "-m", "experiments.train",
        "--config=experiments/configs/tiny_lm_decoupled.py", f"--workdir={workdir}",
        "--config.monitor.enabled=True", "--config.monitor.refresh_s=0.5",
        "--config.train_steps=100000", "--config.inner_steps=16", "--config.log_every=100000",
        "--config.decoupled.fragments=2", "--config.eval.every=300", "--config.eval.batches=1",
        "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
        "--config.model.mlp_hidden=64", "--config.model.seq_len=32", "--config.data.batch_size=4",
        f"--config.chaos={slow}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DD_RUN_TOKEN"}
    out = tmp_path / "launcher.log"
    with out.open("w") as log:
        launcher = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        login = wait_until(
            lambda: (
                re.search(r"job page: (http://\S+)", out.read_text())
                or (launcher.poll() is not None and pytest.fail(out.read_text()[-3000:]))
            ),
            240,
            "the launcher's job page URL",
        ).group(1)
        token = (workdir / "run_token").read_text().strip()
        secret = (workdir / "scrape_token").read_text().strip()  # what Prometheus is given
        wanted = {"syncer", "learner_0", "learner_1"}
        targets = wait_until(
            lambda: (t := _targets(workdir)).keys() >= wanted and t, 240, "every metrics port"
        )

        def scrape_(url: str) -> dict:
            return scrape(url, secret)

        def learner_steps() -> list[float]:
            return [
                next(iter(scrape_(targets[f"learner_{i}"])["dd_learner_step"].values()))
                for i in (0, 1)
            ]

        wait_until(lambda: min(learner_steps()) >= 20, 240, "both learners stepping")
        first = {name: scrape_(url) for name, url in targets.items()}

        def merges(sample: dict) -> float:
            return sum(sample["dd_syncer_merges_total"].values())

        wait_until(
            lambda: (
                merges(scrape_(targets["syncer"])) > merges(first["syncer"])
                and min(learner_steps()) > 40
            ),
            240,
            "merges and steps after the first scrape",
        )
        second = {name: scrape_(url) for name, url in targets.items()}
        for i in (0, 1):
            a, b = first[f"learner_{i}"], second[f"learner_{i}"]
            for counter in (
                "dd_learner_step",
                "dd_learner_tokens_total",
                "dd_learner_sent_bytes_total",
            ):
                assert sum(b[counter].values()) > sum(a[counter].values()), counter
            assert sum(b["dd_learner_push_seconds_count"].values()) > 0
            assert sum(b["dd_learner_state"].values()) == 1  # exactly one state at a time
        s0, s1 = first["syncer"], second["syncer"]
        accepted = lambda x: sum(  # noqa: E731
            v for k, v in x["dd_syncer_pushes_total"].items() if ("outcome", "accepted") in k
        )
        assert accepted(s1) > accepted(s0)
        assert sum(s1["dd_syncer_received_bytes_total"].values()) > sum(
            s0["dd_syncer_received_bytes_total"].values()
        )
        # Every exposed family is documented, and every documented one is exposed.
        exposed = {base_name(n) for sample in second.values() for n in sample}
        assert exposed == documented_names(), exposed ^ documented_names()
        # The run token scrapes the syncer too; a learner never holds it, so refuses it.
        assert _status_code(targets["syncer"], {"Authorization": f"Bearer {token}"}) == 200
        assert _status_code(targets["learner_0"], {"Authorization": f"Bearer {token}"}) == 401
        # Without the token: refused, everywhere.
        page_url = login.split("?")[0]
        for url in [*targets.values(), page_url]:
            assert _status_code(url) == 401, url
            assert _status_code(url, {"Authorization": "Bearer not-the-token"}) == 401, url

        # The page in a real browser: its learners' rows, and the step moving between loads.
        profile = tmp_path / "chromium"
        dom = _browse(chromium, profile, login, "--dump-dom")
        before = _steps(dom)
        assert set(before) == {"0", "1"}, dom[-3000:]
        assert "Fragments" in dom and "<polyline" in dom and "Learner states" in dom
        wait_until(
            lambda: min(learner_steps()) > max(before.values()), 240, "steps past the first load"
        )
        after = _steps(_browse(chromium, profile, page_url, "--dump-dom"))  # on the cookie
        assert all(after[i] > before[i] for i in before), (before, after)
        shot = tmp_path / "page.png"
        _browse(chromium, profile, page_url, f"--screenshot={shot}")
        assert shot.stat().st_size > 10_000
        if os.environ.get("DD_UPDATE_DOCS"):
            SCREENSHOT.parent.mkdir(exist_ok=True)
            shutil.copy(shot, SCREENSHOT)

        # SIGTERM: the launcher stops its children and reaps them.
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
        wait_until(lambda: not _our_processes(workdir), 60, "every child of the run to exit")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
        for pid in _our_processes(workdir):
            os.kill(pid, signal.SIGKILL)
