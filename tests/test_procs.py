"""Child-process hygiene: children of our launcher die with it, hand-started processes do not."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from decoupled_diloco import runtime
from tests.helpers import ROOT, wait_until

pytestmark = pytest.mark.multiprocess  # starts real processes


# A child that asks to die with its parent, says its pid, then waits to be killed.
CHILD = "from decoupled_diloco.runtime import die_with_parent; import os, time; die_with_parent(); print(os.getpid(), flush=True); time.sleep(600)"  # noqa: E501

# A launcher that starts CHILD through `local.procs.Processes`, reports the child's pid, and waits.
LAUNCHER = textwrap.dedent(f"""
    import pathlib, sys, time
    from decoupled_diloco.local.procs import Processes
    from tests.helpers import wait_until
    procs = Processes(pathlib.Path(sys.argv[1]), {{}})
    procs.start("child", [sys.executable, "-c", {CHILD!r}])
    log = pathlib.Path(sys.argv[1]) / "child.log"
    print(wait_until(lambda: log.exists() and log.read_text().strip(), 60, "the child"), flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its (dead) parent's reaper counts as gone.
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_children_of_a_launcher_killed_with_sigkill_follow_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    child = None
    try:
        child = int(launcher.stdout.readline())
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: not _alive(child), 60, "the child to follow its launcher")
    finally:
        launcher.kill()
        launcher.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


# Reads back the parent-death signal (prctl PR_GET_PDEATHSIG) after `die_with_parent`.
GET_SIGNAL = "from decoupled_diloco.runtime import die_with_parent; import ctypes; die_with_parent(); v = ctypes.c_int(); ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"  # noqa: E501


def test_a_process_started_by_hand_is_left_alone():
    proc = subprocess.Popen(
        [sys.executable, "-c", GET_SIGNAL],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != runtime.PARENT_PID_ENV},
        cwd=ROOT,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["0"]  # no parent-death signal set


# A launcher whose clean-up after Ctrl+C hangs (`hung_clean_up`), with a 3 s bound on it; it
# started with SIGINT ignored, as `cmd &` in a non-interactive shell starts it.
HUNG = textwrap.dedent("""
    import signal, threading, time
    from decoupled_diloco import runtime

    def hung_clean_up():
        threading.Event().wait()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a script inherits it
    restore = runtime.exit_on_signals(shutdown_s=3)
    try:
        print("ready", flush=True)  # (inside the try: a signal from now on runs the finally)
        time.sleep(600)
    finally:
        hung_clean_up()
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_hung_clean_up_after_a_signal_is_cut_short_with_its_stacks(sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err  # faulthandler's exit, not the signal's
        assert "Timeout (0:00:03)!" in err and "in hung_clean_up" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_off_the_main_thread_no_handler_is_installed():
    import threading

    before = signal.getsignal(signal.SIGINT)
    got = []
    thread = threading.Thread(target=lambda: got.append(runtime.exit_on_signals()))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGINT) is before
    got[0]()  # restores nothing, raises nothing
    assert signal.getsignal(signal.SIGINT) is before
