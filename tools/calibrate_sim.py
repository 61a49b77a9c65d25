"""Kept for old command lines: `python -m decoupled_diloco.sim calibrate`."""

import sys

from decoupled_diloco.sim.calibrate_cli import main

if __name__ == "__main__":
    sys.exit(main())
