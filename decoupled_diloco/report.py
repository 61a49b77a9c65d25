r"""`python -m decoupled_diloco.report WORKDIR [WORKDIR ...]`: writes each run's `report.md`.

The report itself is `decoupled_diloco.obs.report`.
"""

import sys

from decoupled_diloco.obs.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv))
