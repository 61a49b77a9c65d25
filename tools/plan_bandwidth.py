"""Kept for old command lines: `python -m decoupled_diloco.sim bandwidth`."""

import sys

from decoupled_diloco.sim.bandwidth_cli import main

if __name__ == "__main__":
    sys.exit(main())
