"""A benchmark's section: the Markdown a reader sees and the claims the headline table reads.

Every `tools/bench_NAME.py` writes `benchmarks/results/NAME.md` (its tables, with the command
that produced them and the date) and, beside it, `NAME.json`: the same command and date, the
machine, and its claims (figure, value, the peer's number or the limit it is compared with,
the goal, whether it is met). `tools.run_benchmarks` builds RESULTS.md's headline table from
the claims marked `headline`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shlex
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def machine_description() -> str:
    """CPU model, core count and Python version, for the header of each result."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


@dataclasses.dataclass
class Claim:
    """One measured figure and what it is held against.

    Attributes:
      figure: what was measured, e.g. "decoupled / dp final eval loss, M=2".
      value: the measured number (or a short text, e.g. "0 lost, 0 twice").
      unit: its unit ("" for a ratio).
      baseline: the peer's number or the limit it is compared with ("torchft 0.73").
      goal: the target as the issue states it ("≤ 1.08").
      met: whether the goal is met (None without a goal).
      headline: shown in RESULTS.md's headline table.
      section: the heading of the table it comes from.
      note: how it was read, where that is not plain.
    """

    figure: str
    value: float | int | str
    unit: str = ""
    baseline: str = ""
    goal: str = ""
    met: bool | None = None
    headline: bool = False
    section: str = ""
    note: str = ""


class Section:
    """The result of one benchmark run: its command, date and machine, text and claims.

    Args:
      name: the benchmark's name (`tools/bench_NAME.py`).
      argv: its command-line arguments (default: this process's).
    """

    def __init__(self, name: str, argv: list[str] | None = None):
        self.name = name
        argv = sys.argv[1:] if argv is None else argv
        shown = [a.replace(f"{ROOT}/", "") for a in argv]  # paths as a reader types them
        self.command = shlex.join(["python", "-m", f"tools.bench_{name}", *shown])
        self.date = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
        self.machine = machine_description()
        self.claims: list[Claim] = []

    def header(self) -> str:
        """The line that opens the section: its command, date and machine."""
        return f"Command: `{self.command}` (run {self.date}; machine: {self.machine})."

    def claim(self, figure: str, value: float | int | str, **fields: Any) -> Claim:
        """Records a claim (replacing an earlier one of the same figure) and returns it."""
        self.claims = [c for c in self.claims if c.figure != figure]
        self.claims.append(Claim(figure, value, **fields))
        return self.claims[-1]

    def write(self, out: str | pathlib.Path | None, text: str, title: str = "") -> None:
        """Prints `text`; writes it to `out` and the claims to `out` with `.json`.

        Called after each part of a long benchmark, so that a stopped one keeps what it
        measured.

        Args:
          out: the Markdown file (None or "": print only).
          text: the whole section.
          title: its heading (default: the first line of `text`).
        """
        print(text, flush=True)
        if not out:
            return
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = text if text.endswith("\n") else text + "\n"
        path.write_text(text)
        self._record(path, text, title)

    def append(self, out: str | pathlib.Path | None, text: str) -> None:
        """Prints `text` and appends it to `out`: one part of a section written in parts.

        The claims are merged into those `out`'s record holds (a claim of the same figure is
        replaced), so each part, run in its own process, keeps the others'.
        """
        print(text, flush=True)
        if not out:
            return
        path = pathlib.Path(out)
        old = path.read_text() if path.exists() else ""
        whole = old + ("\n" if old else "") + (text if text.endswith("\n") else text + "\n")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(whole)
        record = path.with_suffix(".json")
        if record.exists() and old:
            mine = {c.figure for c in self.claims}
            earlier = json.loads(record.read_text()).get("claims", [])
            self.claims = [Claim(**c) for c in earlier if c["figure"] not in mine] + self.claims
        self._record(path, whole, "")

    def _record(self, path: pathlib.Path, text: str, title: str) -> None:
        record = {
            "benchmark": self.name,
            "title": title or text.lstrip().splitlines()[0].lstrip("# ").strip(),
            "command": self.command,
            "date": self.date,
            "machine": self.machine,
            "claims": [dataclasses.asdict(c) for c in self.claims],
            "section_sha256": digest(text),
        }
        path.with_suffix(".json").write_text(json.dumps(record, indent=1, ensure_ascii=False))


def digest(text: str) -> str:
    """The SHA-256 of a section's text: its claims were written with exactly this text."""
    return hashlib.sha256(text.encode()).hexdigest()


def load_claims(results: pathlib.Path = RESULTS) -> list[dict[str, Any]]:
    """Every benchmark's record (`NAME.json`), in file-name order.

    A record whose section (`NAME.md`) has been rewritten since, by a benchmark that does not
    record claims or by hand, gets `stale: True`: its claims may no longer be the section's.
    """
    records = []
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        section = path.with_suffix(".md")
        text = section.read_text() if section.exists() else ""
        record["stale"] = digest(text) != record.get("section_sha256")
        records.append(record)
    return records


def headline_table(records: list[dict[str, Any]], order: list[str], limit: int = 20) -> list[str]:
    """RESULTS.md's headline table: the claims marked `headline`, in reading order.

    Args:
      records: the benchmarks' records (`load_claims`).
      order: benchmark names in reading order (others follow by name).
      limit: at most this many rows.

    Raises:
      ValueError: more than `limit` headline claims (the table is a summary: choose).
    """
    rank = {name: i for i, name in enumerate(order)}
    records = sorted(records, key=lambda r: (rank.get(r["benchmark"], len(rank)), r["benchmark"]))
    rows = []
    for record in records:
        for c in record["claims"]:
            if not c.get("headline"):
                continue
            met = {True: "yes", False: "**no**", None: "-"}[c.get("met")]
            value = c["value"]
            shown = f"{value:,.6g}" if isinstance(value, float) else f"{value}"
            unit = c.get("unit") or ""
            shown += unit if unit[:1] in ("×", "%", "") else f" {unit}"
            link = f"[{record['benchmark']}](results/{record['benchmark']}.md)"
            link += " (section rewritten since: rerun it)" if record.get("stale") else ""
            rows.append(
                f"| {c['figure']} | {shown} | {c.get('baseline') or '-'} | "
                f"{c.get('goal') or '-'} | {met} | {link} ({record['date'][:10]}) |"
            )
    if len(rows) > limit:
        raise ValueError(f"{len(rows)} headline claims; the headline table holds {limit}")
    return [
        "| figure | ours | peer or limit | goal | met? | section (run) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
