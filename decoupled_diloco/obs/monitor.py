"""The job page, served: polls the syncer, folds its status into a `page.JobHistory`, serves it.

  monitor = Monitor(client, token, workdir=workdir).start()   # a thread and an HTTP server
  print(monitor.login_url())                                  # http://127.0.0.1:PORT/?token=...
  ...
  monitor.stop()

Routes (every one behind the run token, `obs.http`): `/` the page, `/body` its content (what the
page's script fetches), `/api/status` the latest status and the history as JSON. Used by the
local launcher (`monitor.enabled`) and by `python -m decoupled_diloco.status --serve=PORT`.
Where the run directory is known it also keeps `workdir/prometheus_targets.json` (Prometheus
`file_sd_configs`) up to date from the processes' `*.metrics.port` files.
"""

from __future__ import annotations

import json
import math
import pathlib
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from absl import logging

from decoupled_diloco.obs import page
from decoupled_diloco.obs.http import HttpServer, same_secret

TARGETS_FILE = "prometheus_targets.json"
PORT_SUFFIX = ".metrics.port"  # `workdir/NAME.metrics.port`: NAME's metrics port


def write_targets(workdir: pathlib.Path, host: str = "127.0.0.1") -> list[dict[str, Any]]:
    """Writes `workdir/prometheus_targets.json` from its `*.metrics.port` files; returns it.

    One target group per process, labelled `process` (syncer, syncer_1, learner_0, ...), in the
    format of Prometheus's `file_sd_configs`; `host` is where the processes' metrics bind.
    """
    host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    groups = []
    for path in sorted(workdir.glob(f"*{PORT_SUFFIX}")):
        try:
            port = int(path.read_text())
        except (OSError, ValueError):  # being written
            continue
        name = path.name[: -len(PORT_SUFFIX)]
        groups.append({"targets": [f"{host}:{port}"], "labels": {"process": name}})
    tmp = workdir / (TARGETS_FILE + ".tmp")
    tmp.write_text(json.dumps(groups, indent=1) + "\n")
    tmp.replace(workdir / TARGETS_FILE)
    return groups


class Monitor:
    """Polls `client.status()` every `refresh_s` and serves the page of what it saw.

    Args:
      client: a syncer client (`comm.shards.syncer_client`) holding the run token.
      token: the run token the page asks for (a learner's credential is refused here).
      host: interface the page binds (127.0.0.1: this machine only).
      port: the page's port (0: any free one).
      workdir: the run's directory (timelines, events, metrics ports), or None.
      refresh_s: seconds between polls (and between the page's refreshes).
      title: the page's heading.
      scrape_secret: the run's metrics-only secret (`comm.auth.scrape_secret`): also accepted,
        and what a browser's cookie holds after a login (never the run token).
      close_client: `stop` closes `client` (the monitor's own).
    """

    def __init__(
        self,
        client: Any,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        workdir: str | pathlib.Path | None = None,
        refresh_s: float = 2.0,
        title: str = "decoupled run",
        scrape_secret: str = "",
        close_client: bool = False,
    ):
        self.client, self.token, self.refresh_s = client, token, refresh_s
        self.close_client = close_client
        self.workdir = pathlib.Path(workdir) if workdir else None
        self.history = page.JobHistory(self.workdir, title)
        self._lock = threading.Lock()  # the history: the poller writes, requests read
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        routes = {
            "/": self._text(lambda: page.page(self.history, refresh_s), "text/html"),
            "/body": self._text(lambda: page.render_body(self.history), "text/html"),
            "/api/status": self._text(self._json, "application/json"),
        }
        run, scrape = same_secret(token), same_secret(scrape_secret)
        self.server = HttpServer(
            lambda x: run(x) or scrape(x), routes, host, port, cookie_secret=scrape_secret
        )
        self.host = host

    def login_url(self) -> str:
        """The page's URL with the token: opened once, it leaves a cookie and drops the token."""
        return self.server.url(f"/?token={urllib.parse.quote(self.token, safe='')}")

    def url(self) -> str:
        """The page's URL without the token."""
        return self.server.url("/")

    def note(self, text: str) -> None:
        """Shows `text` at the top of the page (e.g. where the report was written)."""
        with self._lock:
            self.history.notes.append(text)

    def poll_once(self) -> None:
        """One poll of the syncer (and of the run directory's files); never raises."""
        try:
            status = self.client.status()
        except Exception as error:  # noqa: BLE001 - shown on the page; polled again
            code = getattr(error, "code", None)
            reason = f"{code().name}: {error.details()}" if callable(code) else str(error)
            status = None
        try:
            with self._lock:
                if status is None:
                    self.history.failed(reason[:300])
                else:
                    self.history.add(status)
            if self.workdir is not None:
                write_targets(self.workdir, self.host)
        except Exception:  # noqa: BLE001 - a bad line or a vanished directory: poll again
            logging.exception("[monitor] poll failed")

    def start(self) -> Monitor:
        """Polls once, then keeps polling in a thread and serves the page; returns self."""
        self.poll_once()
        self._poller.start()
        self.server.start()
        return self

    def finish(self, text: str) -> None:
        """Stops polling (the run is over) and shows `text`; the page is still served."""
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout=30)
        self.note(text)

    def stop(self) -> None:
        """Stops polling and serving."""
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout=30)
        self.server.stop()
        if self.close_client:
            self.client.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.poll_once()

    def _json(self) -> str:
        h = self.history
        return json.dumps(
            _finite(
                {
                    "status": h.status,
                    "polled_t": h.polled_t,
                    "error": h.error,
                    "merges_per_min": h.merges_per_min,
                    "losses": h.losses,
                    "states": h.spans,
                    "evals": h.evals,
                    "events": h.events,
                    "notes": h.notes,
                }
            ),
            allow_nan=False,
            default=str,
        )

    def _text(self, make: Callable[[], str], kind: str) -> Any:
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            del environ
            with self._lock:
                body = make().encode()
            start_response(
                "200 OK",
                [
                    ("Content-Type", f"{kind}; charset=utf-8"),
                    ("Cache-Control", "no-store"),
                    # Nothing from elsewhere, no framing by another page.
                    ("Content-Security-Policy", _CSP),
                    ("X-Frame-Options", "DENY"),
                ],
            )
            return [body]

        return app


_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"
)


def _finite(x: Any) -> Any:
    """`x` with every non-finite float (a loss before the first step) as None: valid JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
