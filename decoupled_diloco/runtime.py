"""Process set-up that entry points call first: devices, compile cache, parent death.

Fake devices and collective timeouts, before JAX starts:

Islands on CPU are meshes over fake host devices. Their collectives meet in a rendezvous that
XLA:CPU aborts after 40 s by default; on an oversubscribed machine (2 cores running several
islands and processes) one device's thread can be starved that long, and the whole process
dies with "Termination timeout ... of 40 seconds exceeded" (seen in a 2,000-step dp run). The
timeouts are raised here, as the XLA:CPU flags made for uneven workloads allow.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import pathlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

COLLECTIVE_TIMEOUT_S = 3600
# The repository's persistent compilation cache (the Makefile and the tests use it too).
COMPILE_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
_PR_SET_PDEATHSIG = 1
# Set by `local.procs.Processes` in each child's environment: the pid of its parent.
PARENT_PID_ENV = "DD_PARENT_PID"
# How long a launcher's clean-up after Ctrl+C or SIGTERM may take before it is cut short.
SHUTDOWN_S = 45.0
_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds",
    "--xla_cpu_collective_timeout_seconds",
)


def configure_cpu_devices(num_devices: int) -> None:
    """Asks for `num_devices` fake CPU devices and long collective timeouts via XLA_FLAGS.

    Must run before JAX initialises its backend (importing jax is fine; creating arrays or
    listing devices is not). A device count already in XLA_FLAGS is kept. Harmless on GPU/TPU:
    the flags only affect the CPU backend.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not re.search(r"--xla_force_host_platform_device_count=", flags):
        flags += f" --xla_force_host_platform_device_count={max(num_devices, 1)}"
    for flag in _TIMEOUT_FLAGS:
        if flag not in flags:
            flags += f" {flag}={COLLECTIVE_TIMEOUT_S}"
    os.environ["XLA_FLAGS"] = flags.strip()


def jax_started() -> bool:
    """Whether this process's JAX backends are up (then XLA_FLAGS no longer take effect)."""
    from jax._src import xla_bridge  # no public equivalent in jax 0.10

    return xla_bridge.backends_are_initialized()


def share_accelerators() -> None:
    """Lets several JAX processes of one host share its accelerators (before JAX starts).

    JAX preallocates 75% of each GPU's memory in the first process that touches it; the local
    launcher runs the learners, its global evaluator (and, on a one-GPU machine, every
    learner) on the same devices, so the second process would run out of memory. Allocation
    on demand instead (`XLA_PYTHON_CLIENT_PREALLOCATE=false`), unless the environment says
    otherwise. A learner started by hand on a host of its own keeps JAX's default.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def host_cpu_only() -> None:
    """Keeps this process's JAX on the host CPU (the syncer: its arithmetic is host work).

    A syncer on a GPU host would otherwise put its outer step on the first GPU and take 75% of
    its memory from the learners there. Call before JAX's backends start.
    """
    import jax

    jax.config.update("jax_platforms", "cpu")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Makes a child of our launcher follow it: Linux sends `sig` when the parent dies.

    Only for processes started by `local.procs.Processes` (which sets `DD_PARENT_PID`); a learner or
    syncer started by hand, by `nohup` or by a process manager is left alone. A launcher killed
    with SIGKILL cannot clean up; this makes its children follow it. Each child calls this
    first thing after it starts, never in a `preexec_fn`: running Python between fork and exec
    in a launcher with gRPC and JAX threads can deadlock the child before it execs (a lock held
    by another thread at fork time). A parent that died before the call is caught by comparing
    with `DD_PARENT_PID`.
    """
    expected = os.environ.get(PARENT_PID_ENV, "")
    if not expected.isdigit():
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):
        os.kill(os.getpid(), sig)  # the parent is already gone


def exit_on_signals(shutdown_s: float = SHUTDOWN_S) -> Callable[[], None]:
    """SIGINT and SIGTERM end this process through its `finally` blocks, within `shutdown_s`.

    For a launcher: SIGINT raises `KeyboardInterrupt` and SIGTERM `SystemExit(143)` (by default
    SIGTERM ends Python without running `finally`, so children and network namespaces would be
    left behind). The first of them also arms `faulthandler`'s watchdog: if the clean-up has
    not ended the process `shutdown_s` later, every thread's stack is written to stderr (where
    it hung) and the process exits with code 1; the children follow it (`die_with_parent`).
    SIGUSR1 writes every thread's stack to stderr at any time. Returns the function that puts
    the previous handlers back; off the main thread (where Python allows no handlers) nothing
    is installed and it does nothing.

    SIGINT is handled even where it was inherited ignored: a background job of a
    non-interactive shell (`cmd &` in a script, some CI runners) starts with SIGINT ignored,
    and Python keeps that, so such a launcher could not be stopped with Ctrl+C or `kill -INT`:
    it trained on to its end (seen in a test under CI, and in a WAN benchmark run).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    armed: list[bool] = []

    def handler(sig: int, _frame: object) -> None:
        if not armed:  # (a second signal does not extend the deadline)
            armed.append(True)
            exit_within(shutdown_s)
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + sig)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    stderr = _stderr()
    if stderr is not None:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if stderr is not None:
            faulthandler.unregister(signal.SIGUSR1)
        if armed:  # cleaned up in time: the caller may go on (a notebook that caught it)
            faulthandler.cancel_dump_traceback_later()

    return restore


def exit_within(shutdown_s: float = SHUTDOWN_S) -> None:
    """Ends this process `shutdown_s` from now unless it has ended (stacks to stderr, code 1).

    `faulthandler`'s watchdog runs in its own C thread: it fires even if Python is stuck.
    """
    stderr = _stderr()
    if stderr is not None:
        faulthandler.dump_traceback_later(shutdown_s, exit=True, file=stderr)


def _stderr() -> Any:
    """This process's stderr as a file with a descriptor (`faulthandler` writes to the fd).

    Under a capture (pytest, a notebook) `sys.stderr` has none: then the process's own fd 2
    (`sys.__stderr__`); None where there is no such file either.
    """
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):
            continue
    return None


def use_compile_cache(default: pathlib.Path = COMPILE_CACHE) -> None:
    """Turns on JAX's persistent compilation cache (at `default` unless the environment names one).

    A restarted learner then loads its compiled step instead of compiling it again. Call before
    the first compilation; the `JAX_*` environment variables (the Makefile sets them) win.
    """
    import jax

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(default))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def process_start_time() -> float:
    """This process's start as a Unix time (Linux /proc; else now)."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in pathlib.Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def tune_malloc(arenas: int = 2, mmap_threshold: int = 1 << 20) -> None:
    """Sets glibc's malloc up for fragment-sized buffers: few arenas, large blocks mapped.

    `mallopt(M_ARENA_MAX)`: glibc gives each new thread its own arena (up to 8 per core), and
    each keeps what its thread freed: a syncer's gRPC threads, each receiving 1 MiB chunks,
    held ~0.5 GB more at M = 8 learners than at 2 (125M model, measured: peak 4.5-5.0x the
    model uncapped, 3.8-4.1x capped at 2, pushes as fast).

    `mallopt(M_MMAP_THRESHOLD)`: glibc raises its mmap threshold to the size of each mapped
    block it frees (up to 32 MiB), so after the first fragment-sized temporaries every later
    one of a tensor's size comes from the heap, where freed blocks stay in the process: a
    synthetic 125M learner's RSS grew ~0.1 GB with each push (2.06 GB after 120 steps). A
    fixed threshold (which stops the raising) hands every such block back when it is freed:
    the same loop peaked at 1.71 GB and came back to its floor after each push. For the
    syncer (125M, M = 8) no change stood out of the spread between runs: 3.5-4.3x the model
    with it, 3.8-3.9x without (`tools/bench_scale`, benchmarks/results/scale.md).

    Call before the threads start (arenas already made are not capped); elsewhere than
    glibc, nothing.
    """
    _mallopt(-8, arenas)  # M_ARENA_MAX
    _mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD


def _mallopt(option: int, value: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(option, value)
    except (OSError, AttributeError):
        pass


def xla_host_vector(n: int, device: Any) -> tuple[Any, np.ndarray]:
    """A zeroed float32 vector that XLA owns in host memory, and a writable numpy view of it.

    For buffers that numpy fills and an XLA step then consumes by donation, writing its
    output into the same memory (`core.accumulate.RoundSum`): XLA reuses only memory it
    allocated itself. The view does not keep the array alive, and once the array is donated
    or dropped the view must not be used again. `device` must be a CPU device (the memory is
    the host's).
    """
    import jax
    import jax.numpy as jnp

    if device.platform != "cpu" or n <= 0:
        raise ValueError(f"a host vector needs a CPU device and n > 0 (got {device}, {n})")
    owned = jax.device_put(jnp.zeros(n, jnp.float32), device).block_until_ready()
    memory = (ctypes.c_float * n).from_address(owned.unsafe_buffer_pointer())
    return owned, np.ctypeslib.as_array(memory)


def trim_memory() -> None:
    """Returns the C heap's free memory to the OS (glibc `malloc_trim`; elsewhere nothing).

    glibc keeps freed memory in its arenas: after XLA initialises a model on the CPU, or after
    a merge's and a snapshot's temporaries on many threads, a process's RSS would stay at its
    high-water mark (measured: 2.7 GB retained after initialising a 1.5 GB model, 1.7 GB once
    trimmed). The syncer calls this after start-up, merges and snapshots.

    First a young-generation garbage collection, for what it runs: JAX frees some arrays only
    from its collector callback (jax-ml/jax#14882), among them the XLA buffers behind numpy
    views that were dropped, as a syncer's replaced merged values are (`FlatStep`). Measured on
    one 85 MB fragment's closes: 2 fragments held until the next collection otherwise.
    """
    gc.collect(0)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
