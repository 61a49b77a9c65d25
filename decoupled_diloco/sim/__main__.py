"""`python -m decoupled_diloco.sim COMMAND ...`: the simulator and the planner (docs/simulator.md).

    python -m decoupled_diloco.sim goodput [--sweep --plot=PATH ...]   # goodput under failures
    python -m decoupled_diloco.sim bandwidth --params=1B --step_time_s=0.1   # link planning
    python -m decoupled_diloco.sim calibrate RUN_DIR [RUN_DIR ...]   # against measured runs

`python -m decoupled_diloco.sim COMMAND --help` lists each command's flags.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from decoupled_diloco.sim import bandwidth_cli, calibrate_cli, goodput_cli

COMMANDS: dict[str, Callable[[Sequence[str] | None], object]] = {
    "goodput": goodput_cli.main,
    "bandwidth": bandwidth_cli.main,
    "calibrate": calibrate_cli.main,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command `argv[0]` names with the rest of `argv`; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(f"{given}usage: python -m decoupled_diloco.sim {{{','.join(COMMANDS)}}} ...")
        print(__doc__.split("\n\n")[1])
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    result = COMMANDS[argv[0]](argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
