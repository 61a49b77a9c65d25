"""Runs every `tools/bench_*.py` benchmark and collects their sections into benchmarks/RESULTS.md.

Each benchmark is a module with a `main` that accepts `--out=PATH` and writes one Markdown section
(its numbers and the exact command that produced them) and, beside it, its claims as
`NAME.json` (`tools.benchkit.section`). Run one alone with
`python -m tools.bench_<name> --out=benchmarks/results/<name>.md`, or all with `make bench`.
Pass `--only=name1,name2` to rerun a subset; the other sections are kept from their last run.
RESULTS.md opens with the headline table built from the claims marked `headline`; the sections
follow in reading order. Superseded runs live in benchmarks/history/.
"""

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys

from tools.benchkit.section import RESULTS, ROOT, headline_table, load_claims, machine_description
from tools.decoupled_variants import BEFORE_GATHER_DEFAULTS

RESULTS_DIR = RESULTS
# RESULTS.md's reading order: quality first, then the decoupled mode, compression, WAN, faults,
# scale, GPU; a benchmark not named here follows in alphabetical order.
READING_ORDER = [
    "quality", "tokens", "decode", "decoupled", "defaults", "models", "muon", "merge_lag",
    "compression", "transport", "sync_overhead", "wan",
    "chaos", "calibration", "goodput", "restart", "elastic", "security",
    "scale", "multihost", "throughput", "data", "demo", "gpu",
]  # fmt: skip


def _relinked(text: str) -> str:
    """A section's relative links (written from results/) as seen from benchmarks/RESULTS.md."""

    def fix(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^([a-z]+:|#|/)", target):
            return match.group(0)
        shown = os.path.relpath((RESULTS_DIR / target).resolve(), ROOT / "benchmarks")
        return f"{match.group(1)}({pathlib.PurePath(shown).as_posix()})"

    return re.sub(r"(!?\[[^\]]*\])\(([^)\s]+)\)", fix, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument(
        "--collect", action="store_true", help="only rebuild RESULTS.md from the saved sections"
    )
    args = parser.parse_args()
    names = sorted(p.stem[len("bench_") :] for p in (ROOT / "tools").glob("bench_*.py"))
    # calibration reads the runs that chaos produces, so it goes after it.
    names.sort(key=lambda n: n == "calibration")
    chosen = [] if args.collect else ([n for n in args.only.split(",") if n] or names)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; available: {names}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in chosen:
        out = RESULTS_DIR / f"{name}.md"
        cmd = [sys.executable, "-m", f"tools.bench_{name}", f"--out={out}"]
        print(f"[bench] {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(name)
    sections = [
        "# Benchmark results\n",
        f"Collected by `make bench` (`python -m tools.run_benchmarks`) on "
        f"{datetime.date.today().isoformat()}; machine: {machine_description()}.\n"
        "Each section names the command that produced it and the date it was run; "
        "`benchmarks/results/NAME.md` holds each section as its benchmark last wrote it.\n",
        # The decoupled defaults changed on 2026-12-01 (gather + share); the benchmarks now pin
        # the old ones themselves, but command lines written before do not show them.
        "Command lines in sections written before the `decoupled.*` defaults became gather + "
        "share (2026-12-01, 09:00) ran with the defaults of that time; to rerun one by hand, put "
        + " ".join(f"`--config.{k}={v}`" for k, v in BEFORE_GATHER_DEFAULTS.items())
        + " before its own `--config.*` flags (the benchmarks pin them themselves: "
        "`tools/decoupled_variants.py`).\n",
    ]
    order = READING_ORDER + sorted(set(names) - set(READING_ORDER))
    sections += [
        "## Headline\n",
        "Each row is a claim a benchmark recorded (`benchmarks/results/NAME.json`: the figure, "
        "the value measured, the peer's number or the limit, the goal, the command and the date), "
        "linked to its section; the sections follow in reading order.\n",
        "\n".join(headline_table(load_claims(RESULTS_DIR), order)) + "\n",
    ]
    # (gpu.md is written by tools/device_check.py on a GPU machine, not by a bench_ script.)
    for name in order:
        path = RESULTS_DIR / f"{name}.md"
        if path.exists():
            sections.append(_relinked(path.read_text()))
    (ROOT / "benchmarks" / "RESULTS.md").write_text("\n".join(sections))
    print(f"[bench] wrote {ROOT / 'benchmarks' / 'RESULTS.md'}")
    if failed:
        sys.exit(f"benchmarks failed: {failed}")


if __name__ == "__main__":
    main()
