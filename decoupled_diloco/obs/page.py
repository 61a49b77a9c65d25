"""The live job page: a history folded from the syncer's status, rendered as one HTML page.

`JobHistory` folds status polls (`SyncerState.status`) into what the page shows: per learner
its latest row, loss curve and state timeline; per fragment its version and merges; merges per
minute. With the run's directory it also reads, as they grow, the learners' timelines
(`obs.timeline`: stepping, compiling, restoring, down, ...) and the fault and recovery events
and global evaluations in `metrics.jsonl`. `render_body` turns it into HTML (tables and inline
SVG charts); `page` wraps that in a document whose script fetches `/body` again every few
seconds. Self-contained: no script, style or font from anywhere else. Pure: no I/O but the
run directory's files, so the page can be checked without a browser.
"""

from __future__ import annotations

import bisect
import collections
import html
import json
import math
import pathlib
import time
from typing import Any

from decoupled_diloco.obs import timeline_plot
from decoupled_diloco.obs.watch import MergeRate, goodput_text

MAX_POINTS = 400  # loss points kept per learner: older ones are thinned, never all dropped
MAX_SPANS = 2000  # state changes kept per learner
# The timeline's colours (`obs.timeline_plot`), and the states heartbeats report.
COLORS = {
    **timeline_plot.COLORS,
    "training": timeline_plot.COLORS["stepping"],
    "registered": "#c6dbef",
    "done": "#dddddd",
}
_LINES = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


class _Tail:
    """Complete lines appended to a file since the last read (a cut last line waits)."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset = path, 0

    def lines(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(8 << 20)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        return [x for x in out if isinstance(x, dict)]


class JobHistory:
    """What the page shows, folded from status polls and the run directory's files.

    Args:
      workdir: the run's directory (timelines, `metrics.jsonl`), or None (polls only).
      title: the page's heading.
    """

    def __init__(self, workdir: str | pathlib.Path | None = None, title: str = "decoupled run"):
        self.workdir = pathlib.Path(workdir) if workdir else None
        self.title = title
        self.status: dict[str, Any] = {}
        self.polled_t = 0.0  # unix time of the last good poll
        self.error = ""  # why the last poll failed ('' if it did not)
        self.started_t = time.time()
        self.losses: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
        self.spans: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        self.evals: list[tuple[int, float]] = []
        self.events: list[dict[str, Any]] = []
        self.notes: list[str] = []  # e.g. "report written: PATH"
        self.merges_per_min: float | None = None
        self._rate = MergeRate()
        self._tails: dict[pathlib.Path, _Tail] = {}

    def add(self, status: dict[str, Any], now: float | None = None) -> None:
        """Folds one status poll in (`now`: its unix time)."""
        now = time.time() if now is None else now
        self.status, self.polled_t, self.error = status, now, ""
        self.merges_per_min = self._rate.update(status)
        self._read_files()
        for i, x in status.get("learners", {}).items():
            self._point(i, x.get("step", 0), x.get("loss"))
            if not self._has_timelines():
                self._enter(i, now, str(x.get("state", "?")))

    def _point(self, learner: str, step: Any, loss: Any) -> None:
        points = self.losses[learner]
        if not (isinstance(loss, int | float) and math.isfinite(loss) and isinstance(step, int)):
            return
        if not points or step > points[-1][0]:
            points.append((step, float(loss)))
        if len(points) > MAX_POINTS:  # keep the shape: every other old point goes
            points[:] = points[:-50:2] + points[-50:]

    def state_of(self, learner: str) -> str:
        """The learner's latest recorded state ('' if none)."""
        spans = self.spans.get(learner)
        return spans[-1][1] if spans else ""

    def failed(self, error: str, now: float | None = None) -> None:
        """Records a poll that failed (the syncer restarting, say)."""
        self.error = error
        self._read_files()

    def _has_timelines(self) -> bool:
        return self.workdir is not None and (self.workdir / "timeline").is_dir()

    def _enter(self, learner: str, t: float, state: str) -> None:
        """Records a state change at `t`, in time order (several files name one learner)."""
        spans = self.spans[learner]
        at = bisect.bisect_right(spans, t, key=lambda x: x[0])
        if at == 0 or spans[at - 1][1] != state:
            spans.insert(at, (t, state))
            if at + 1 < len(spans) and spans[at + 1][1] == state:  # the next one repeats it
                del spans[at + 1]
            del spans[:-MAX_SPANS]

    def _tail(self, path: pathlib.Path) -> list[dict[str, Any]]:
        if path not in self._tails:
            self._tails[path] = _Tail(path)
        return self._tails[path].lines()

    def _read_files(self) -> None:
        if self.workdir is None:
            return
        if self._has_timelines():
            for path in sorted((self.workdir / "timeline").glob("*.jsonl")):
                for record in self._tail(path):
                    for learner in record.get("learners", []):
                        self._enter(str(learner), float(record.get("t", 0)), str(record["state"]))
        for event in self._tail(self.workdir / "metrics.jsonl"):
            if event.get("event") in ("fault", "crash", "recovery"):
                self.events.append(event)
                del self.events[:-200]
                continue
            loss = event.get("eval_loss")
            step = event.get("step", 0)
            if isinstance(loss, int | float) and math.isfinite(loss) and isinstance(step, int):
                self.evals.append((step, float(loss)))
                del self.evals[:-MAX_POINTS]
            ids, steps, losses = (
                event.get(k) for k in ("learner_ids", "learner_steps", "learner_losses")
            )
            if isinstance(ids, list) and isinstance(steps, list) and isinstance(losses, list):
                # The launcher's progress events: the curves from the run's start, even for a
                # page started late (`status --serve --workdir`).
                for i, step, loss in zip(ids, steps, losses, strict=False):
                    self._point(str(i), step, loss)


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, int | float) and math.isfinite(x) else "-"


def _table(head: list[str], rows: list[list[str]], cls: str) -> str:
    top = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{top}</tr></thead><tbody>{body}</tbody></table>'


def _badge(state: str) -> str:
    color = COLORS.get(state, "#ffe08a")
    ink = "#fff" if state in ("down", "checkpointing", "restoring") else "#222"
    return f'<span class="state" style="background:{color};color:{ink}">{_esc(state)}</span>'


def _learner_rows(history: JobHistory) -> list[list[str]]:
    status, rows = history.status, []
    for i, x in status.get("learners", {}).items():
        state = str(x.get("state", "?"))
        age = x.get("heartbeat_age_s", math.nan)
        late = isinstance(age, int | float) and age > 10
        rows.append(
            [
                _esc(i),
                _badge(history.state_of(i) or state),
                _esc(x.get("mesh", "")),
                f'<span class="step">{_esc(x.get("step", 0))}</span>',
                _num(x.get("loss"), ".4f"),
                _esc(x.get("staleness", 0)),
                f'<span class="{"late" if late else ""}">{_num(age, ".1f")}</span>',
                _esc(x.get("versions", [])),
                _esc(x.get("incarnation", 0)),
            ]
        )
    return rows


def _fragment_rows(status: dict[str, Any]) -> list[list[str]]:
    return [
        [
            _esc(p),
            _esc(f.get("version", 0)),
            _esc(f.get("merges", 0)),
            _esc(f.get("pending", [])),
            _esc(f.get("accepted_pushes", "-")),
            _esc(f.get("late_pushes", 0)),
            _esc(f.get("duplicate_pushes", 0)),
            _esc(f.get("refused_merges", 0)),
            f"{f.get('bytes', 0):,}",
        ]
        for p, f in enumerate(status.get("fragments", []))
    ]


def _loss_chart(history: JobHistory, width: int = 760, height: int = 240) -> str:
    curves = {i: p for i, p in history.losses.items() if p}
    points = [pt for p in curves.values() for pt in p] + history.evals
    if not points:
        return '<p class="empty">no loss reported yet</p>'
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1e-6)
    pad = 40

    def xy(step: float, value: float) -> str:
        x = pad + (step - x0) / (x1 - x0) * (width - 2 * pad)
        y = height - pad - (value - y0) / (y1 - y0) * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}">',
        f'<rect x="{pad}" y="{pad / 2}" width="{width - 2 * pad}" height="{height - 1.5 * pad}" '
        'class="frame"/>',
        f'<text x="{pad}" y="{height - 8}">step {x0}</text>',
        f'<text x="{width - pad}" y="{height - 8}" text-anchor="end">{x1}</text>',
        f'<text x="4" y="{pad / 2 + 10}">{y1:.3f}</text>',
        f'<text x="4" y="{height - pad}">{y0:.3f}</text>',
    ]
    for k, (i, p) in enumerate(sorted(curves.items())):
        color = _LINES[k % len(_LINES)]
        line = " ".join(xy(s, v) for s, v in p)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>')
        parts.append(
            f'<text x="{width - pad + 4}" y="{pad + 14 * k}" style="fill:{color}">L{_esc(i)}</text>'
        )
    for s, v in history.evals:
        parts.append(f'<circle cx="{xy(s, v).split(",")[0]}" cy="{xy(s, v).split(",")[1]}" r="3" '
                     'class="eval"><title>global eval</title></circle>')  # fmt: skip
    if history.evals:
        parts.append(
            f'<text x="{width - pad + 4}" y="{pad + 14 * len(curves)}">&#9679; eval</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _timeline_chart(history: JobHistory, now: float, width: int = 760) -> str:
    spans = {i: s for i, s in history.spans.items() if s}
    if not spans:
        return '<p class="empty">no state recorded yet</p>'
    t0 = min(s[0][0] for s in spans.values())
    t1 = max(now, t0 + 1)
    row, pad = 22, 60
    height = row * len(spans) + 30

    def x(t: float) -> float:
        return pad + (t - t0) / (t1 - t0) * (width - pad - 10)

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}">'
    ]
    for k, (i, changes) in enumerate(sorted(spans.items(), key=lambda kv: kv[0])):
        y = 4 + k * row
        parts.append(f'<text x="4" y="{y + 14}">learner {_esc(i)}</text>')
        ends = [t for t, _ in changes[1:]] + [t1]
        for (start, state), end in zip(changes, ends, strict=True):
            w = max(x(end) - x(start), 0.5)
            parts.append(
                f'<rect x="{x(start):.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" '
                f'fill="{COLORS.get(state, "#ffe08a")}"><title>{_esc(state)}</title></rect>'
            )
    rows = {i: k for k, i in enumerate(sorted(spans))}
    for event in history.events:
        t = float(event.get("time", 0))
        if not t0 <= t <= t1:
            continue
        kind = "recovery" if event.get("event") == "recovery" else "fault"  # a crash is one
        named = event.get("learners", [event["learner"]] if "learner" in event else [])
        marked = [rows[str(i)] for i in named if str(i) in rows] or None  # None: the whole job
        what = _esc(f"{kind}: {event.get('kind', '')} {event.get('process', named)}")
        for k in marked or [None]:
            y0, y1 = (0, height - 26) if k is None else (2 + k * row, k * row + row)
            parts.append(
                f'<line class="{kind}" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y0}" y2="{y1}">'
                f"<title>{what}</title></line>"
            )
    parts.append(
        f'<text x="{pad}" y="{height - 8}">{time.strftime("%H:%M:%S", time.localtime(t0))}</text>'
    )
    parts.append(f'<text x="{width - 10}" y="{height - 8}" text-anchor="end">now</text></svg>')
    legend = " ".join(_badge(s) for s in COLORS if s not in ("training", "registered", "done"))
    marks = '<span class="mark fault">fault</span> <span class="mark recovery">recovery</span>'
    return "".join(parts) + f'<div class="legend">{legend} {marks}</div>'


def render_body(history: JobHistory, now: float | None = None) -> str:
    """The page's content for the history as it stands (HTML, everything escaped)."""
    now = time.time() if now is None else now
    status = history.status
    head = [
        f"syncer up {_num(status.get('uptime_s'), '.0f')} s",
        f"merges {status.get('merges', 0)}",
    ]
    if history.merges_per_min is not None:
        head.append(f"{history.merges_per_min:.1f} merges/min")
    goodput = goodput_text(status)
    if goodput:
        head.append(goodput)
    shown = time.strftime("%H:%M:%S", time.localtime(history.polled_t)) if history.polled_t else "-"
    head.append(f"updated {shown}")
    warning = (
        f'<p class="warn">syncer unreachable: {_esc(history.error)} (shown: the last good poll)</p>'
        if history.error
        else ""
    )
    learner_head = [
        "learner",
        "state",
        "mesh",
        "step",
        "loss",
        "stale",
        "beat s",
        "versions",
        "restarts",
    ]
    fragment_head = [
        "fragment",
        "version",
        "merges",
        "pending",
        "accepted",
        "late",
        "dup",
        "refused merges",
        "bytes",
    ]
    events = "".join(
        f"<li>{_esc(time.strftime('%H:%M:%S', time.localtime(float(e.get('time', 0)))))} "
        f"{_esc(json.dumps({k: v for k, v in e.items() if k not in ('time', 'wall_s')}))}</li>"
        for e in history.events[-12:]
    )
    notes = "".join(f"<p class='note'>{_esc(n)}</p>" for n in history.notes)
    faults = f"<ul>{events}</ul>" if events else '<p class="empty">none</p>'
    return (
        f"<h1>{_esc(history.title)}</h1>{notes}{warning}"
        f'<p class="head">{" | ".join(_esc(h) for h in head)}</p>'
        f"<h2>Learners</h2>{_table(learner_head, _learner_rows(history), 'learners')}"
        f"<h2>Fragments</h2>{_table(fragment_head, _fragment_rows(status), 'fragments')}"
        f"<h2>Loss</h2>{_loss_chart(history)}"
        f"<h2>Learner states</h2>{_timeline_chart(history, now)}"
        f"<h2>Faults and recoveries</h2>{faults}"
    )


_STYLE = """
body{font:14px system-ui,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
th{background:#f4f4f4} .learners td:nth-child(2),.learners td:nth-child(8){text-align:left}
.state{padding:1px 6px;border-radius:3px;font-size:12px}
.late{color:#c00;font-weight:bold} .warn{color:#c00} .note{color:#064;font-weight:bold}
.empty{color:#888} .head{color:#444}
svg.chart{background:#fff} svg text{font-size:11px;fill:#555}
rect.frame{fill:none;stroke:#ccc} circle.eval{fill:#000}
line.fault{stroke:#d00;stroke-width:2}
line.recovery{stroke:#0a0;stroke-width:2;stroke-dasharray:4 2}
.legend{font-size:12px;margin-top:4px} .mark.fault{color:#d00} .mark.recovery{color:#0a0}
"""


def page(history: JobHistory, refresh_s: float = 2.0) -> str:
    """The whole document: the body as it stands, and a script that refreshes it."""
    ms = max(int(refresh_s * 1000), 250)
    # A failed refresh says so (a page that silently stops moving would look like a stall).
    script = (
        "<script>const stale=document.getElementById('stale');"
        "setInterval(async()=>{try{const r=await fetch('/body',{cache:'no-store'});"
        "if(r.ok){document.getElementById('main').innerHTML=await r.text();"
        "stale.textContent='';}else{stale.textContent=r.status==401?'Logged out: open the "
        "URL with ?token= again.':'Not updated: HTTP '+r.status+'.';}}catch(e){"
        "stale.textContent='Not updated: the page server does not answer (the run ended?).';}"
        f"}},{ms});</script>"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_esc(history.title)}'
        f'</title><style>{_STYLE}</style><noscript><meta http-equiv="refresh" '
        f'content="{max(int(refresh_s), 1)}"></noscript></head>'
        f'<body><p id="stale" class="warn"></p><div id="main">{render_body(history)}</div>'
        f"{script}</body></html>"
    )
