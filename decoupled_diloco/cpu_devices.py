"""Process set-up for JAX on CPU: fake devices and collective timeouts, before JAX starts.

Islands on CPU are meshes over fake host devices. Their collectives meet in a rendezvous that
XLA:CPU aborts after 40 s by default; on an oversubscribed machine (2 cores running several
islands and processes) one device's thread can be starved that long, and the whole process
dies with "Termination timeout ... of 40 seconds exceeded" (seen in a 2,000-step dp run). The
timeouts are raised here, as the XLA:CPU flags made for uneven workloads allow.
"""

from __future__ import annotations

import os
import re

COLLECTIVE_TIMEOUT_S = 3600
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
