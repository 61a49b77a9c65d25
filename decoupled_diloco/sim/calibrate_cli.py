"""`python -m decoupled_diloco.sim calibrate RUN_DIR [RUN_DIR ...]`: simulator vs measured goodput.

The calibration itself is `decoupled_diloco.sim.calibration` (its docstring says which model and
why; docs/simulator.md, "Calibration").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from decoupled_diloco.sim.calibration import table


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: prints the calibration table for the given run directories."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished chaos run directories")
    parser.add_argument("--pooled", action="store_true", help="decoupled: the pooled engine")
    parser.add_argument("--real_h", action="store_true", help="--pooled with H = sync period")
    args = parser.parse_args(argv)
    print("\n".join(table(args.runs, pooled=args.pooled, real_h=args.real_h)))
