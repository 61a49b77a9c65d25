"""The live view of `python -m decoupled_diloco.status --watch`: rich tables, refreshed.

`render` turns one status dict (see `SyncerState.status`) into tables of learners (state, step,
loss, staleness, heartbeat age, fragment versions) and fragments (version, merges, late and
duplicate pushes, pending learners), plus a footer with merges per minute, the grace-window
averages and goodput, when the syncer reports one. It is a pure function of the status, so the
launcher or a notebook can show the same view.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

_STATE_STYLE = {"training": "green", "done": "dim", "registered": "cyan"}
_RATE_WINDOW_S = 60.0


class MergeRate:
    """Merges per minute over the last minute of samples (or since start, at first)."""

    def __init__(self, window_s: float = _RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, status: dict[str, Any]) -> float | None:
        """Adds one status sample; returns merges per minute, or None if unknown."""
        uptime, merges = status.get("uptime_s"), status.get("merges", 0)
        if uptime is None:
            return None
        if self.samples and uptime < self.samples[-1][0]:  # The syncer restarted.
            self.samples.clear()
        self.samples.append((uptime, merges))
        while len(self.samples) > 2 and uptime - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, m0 = self.samples[0]
        if len(self.samples) == 1:
            t0, m0 = 0.0, 0
        return 60.0 * (merges - m0) / (uptime - t0) if uptime > t0 else None


def _number(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, int | float) and x == x else "-"


def goodput_text(status: dict[str, Any]) -> str | None:
    """The status's goodput (a number or a dict of numbers) as text; None if it has none."""
    value = status.get("goodput")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"goodput {value:.3f}"
    if isinstance(value, dict):
        items = [f"{k} {v:.3f}" for k, v in value.items() if isinstance(v, int | float)]
        return "goodput: " + ", ".join(items) if items else None
    return None


def render(status: dict[str, Any], merges_per_min: float | None = None, title: str = "") -> Group:
    """The learners table, the fragments table and a footer line for one status."""
    learners = Table(title=title or None, title_justify="left", expand=False)
    for name in ("learner", "state", "mesh", "step", "loss", "stale", "beat s", "versions"):
        learners.add_column(name, justify="left" if name in ("state", "versions") else "right")
    for i, x in status.get("learners", {}).items():
        age = x.get("heartbeat_age_s", float("nan"))
        learners.add_row(
            str(i),
            Text(str(x.get("state", "?")), style=_STATE_STYLE.get(x.get("state"), "yellow")),
            str(x.get("mesh", "")),
            str(x.get("step", 0)),
            _number(x.get("loss"), ".3f"),
            str(x.get("staleness", 0)),
            Text(_number(age, ".1f"), style="red" if age == age and age > 10 else ""),
            str(x.get("versions", [])),
        )
    fragments = Table(expand=False)
    for name in ("fragment", "version", "merges", "late", "dup", "pending", "bytes"):
        fragments.add_column(name, justify="right")
    for p, f in enumerate(status.get("fragments", [])):
        fragments.add_row(
            str(p),
            str(f.get("version", 0)),
            str(f.get("merges", 0)),
            str(f.get("late_pushes", 0)),
            str(f.get("duplicate_pushes", 0)),
            str(f.get("pending", [])),
            f"{f.get('bytes', 0):,}",
        )
    ema = status.get("ema", {})
    footer = [f"merges {status.get('merges', 0)}"]
    if merges_per_min is not None:
        footer.append(f"{merges_per_min:.1f}/min")
    if "uptime_s" in status:
        footer.append(f"syncer up {status['uptime_s']:.0f}s")
    if ema:
        footer.append(
            f"EMA step {ema.get('step_s', 0) * 1e3:.1f} ms, quorum "
            f"{ema.get('quorum_s', 0) * 1e3:.1f} ms, sync {ema.get('sync_s', 0) * 1e3:.1f} ms"
        )
    shards = status.get("shards")
    if isinstance(shards, list) and shards:
        up = sum(1 for x in shards if x.get("up"))
        footer.append(f"shards up {up}/{len(shards)}")
    goodput = goodput_text(status)
    if goodput:
        footer.append(goodput)
    changes = [  # joins, restarts, leaves and losses (the syncer's membership log)
        f"L{e.get('learner')} {e.get('event')}" for e in status.get("membership", [])[-4:]
    ]
    if changes:
        footer.append("membership: " + ", ".join(changes))
    return Group(learners, fragments, Text(" | ".join(footer)))


def watch(client: Any, address: str, interval_s: float = 2.0, count: int = 0) -> None:
    """Refreshes the view every `interval_s` until Ctrl+C (or `count` refreshes, if > 0).

    An unreachable syncer (restarting, say) is shown as such and polled again.
    """
    rate = MergeRate()
    done = 0
    with Live(Text(f"connecting to {address} ..."), auto_refresh=False) as live:
        try:
            while True:
                stamp = time.strftime("%H:%M:%S")
                try:
                    status = client.status()
                    view: Any = render(status, rate.update(status), f"syncer {address} {stamp}")
                except Exception as error:  # noqa: BLE001 - shown, and polled again.
                    code = getattr(error, "code", None)
                    reason = f"{code().name}: {error.details()}" if callable(code) else str(error)
                    view = Text(f"{stamp} syncer {address} unreachable ({reason}); retrying")
                live.update(view, refresh=True)
                done += 1
                if count and done >= count:
                    return
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return


class RunProgress:
    """The launcher's progress: a live table on a terminal, one plain line per poll otherwise.

    Logs, pipes and tests get the plain lines (one per poll, grep-able); a user at a terminal
    gets the same table as `status --watch`, refreshed in place.
    """

    def __init__(self, title: str, live: bool | None = None):
        import sys

        self.title, self.rate = title, MergeRate()
        use_live = sys.stdout.isatty() if live is None else live
        self.live = Live(Text(f"{title}: starting ..."), auto_refresh=False) if use_live else None
        if self.live is not None:
            self.live.start()

    def show(self, status: dict[str, Any], line: str, elapsed_s: float) -> None:
        """Shows one poll's `status` (as a table) or its one-`line` summary."""
        if self.live is None:
            print(line, flush=True)
            return
        title = f"{self.title} {elapsed_s:.0f}s"
        self.live.update(render(status, self.rate.update(status), title), refresh=True)

    def close(self) -> None:
        """Leaves the last table on screen."""
        if self.live is not None:
            self.live.stop()
