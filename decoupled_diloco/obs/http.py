"""A small HTTP server for operators: Prometheus `/metrics` and the job page, behind a secret.

Every request must carry a secret the process accepts (`check`: the run token, or the run's
metrics-only scrape secret, `comm.auth.scrape_secret`) before any route runs: an
`Authorization: Bearer SECRET` header (what Prometheus sends with
`authorization: {credentials_file: ...}`), or the cookie that one visit to `/?token=SECRET` sets
for a browser (HttpOnly, SameSite=Strict, named after the port, holding `cookie_secret` rather
than the token itself when one is given). Anything else gets 401; only GET and HEAD are served.
Connections are bounded: at most `max_connections` at once (more are closed at once), each
closed `deadline_s` after it opened whatever it is doing, so that idle or trickling clients
cannot hold the server. It binds 127.0.0.1 unless told otherwise.

  server = HttpServer(same_secret(token), {"/metrics": metrics_app(registry)}).start()
"""

from __future__ import annotations

import hmac
import http.cookies
import pathlib
import socket
import socketserver
import sys
import threading
import time
import urllib.parse
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from typing import Any

import prometheus_client

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_WEEK_S = 7 * 24 * 3600  # the cookie outlives the browser for a week
_REFUSED = (
    b"401: missing or wrong run token. Send the header 'Authorization: Bearer TOKEN', or open "
    b"/?token=TOKEN once in a browser.\n"
)


def same_secret(secret: str) -> Callable[[str], bool]:
    """A check that accepts exactly `secret` (compared in constant time)."""
    want = secret.encode()
    return lambda presented: bool(want) and hmac.compare_digest(presented.encode(), want)


def metrics_app(registry: prometheus_client.CollectorRegistry) -> WsgiApp:
    """The Prometheus exposition of `registry` (text or OpenMetrics, as the scraper asks)."""
    return prometheus_client.make_wsgi_app(registry)


def write_port(path: str | pathlib.Path, port: int) -> None:
    """Writes `port` to `path` whole (write, then rename): a reader never sees half of it."""
    path = pathlib.Path(path)
    path.with_suffix(".tmp").write_text(str(port))
    path.with_suffix(".tmp").replace(path)


def serve_on(port: int, make: Callable[[int], HttpServer], name: str) -> HttpServer:
    """`make(port)`, or `make(0)` (any free port, said on stderr) if `port` cannot be bound.

    A process's metrics are worth less than the process: a port taken meanwhile (the launcher
    chose it before the process started) must not end a learner or a syncer.
    """
    try:
        return make(port)
    except RuntimeError as error:
        if port == 0:
            raise
        print(f"{name}: {error}; serving on any free port instead", file=sys.stderr, flush=True)
        return make(0)


def presented_secret(environ: dict[str, Any], cookie: str) -> str:
    """The secret a request carries: its bearer token, else its `cookie` ('' if none)."""
    header = environ.get("HTTP_AUTHORIZATION", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    cookies = http.cookies.SimpleCookie()
    try:
        cookies.load(environ.get("HTTP_COOKIE", ""))
    except http.cookies.CookieError:
        return ""
    return cookies[cookie].value if cookie in cookies else ""


class _Handler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = 5.0  # per read; the whole connection is bounded by the server's deadline

    def log_message(self, *args: Any) -> None:  # no line per scrape on stderr
        del args


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted process binds its old port at once
    slots: threading.BoundedSemaphore
    deadline_s: float

    def server_activate(self) -> None:
        super().server_activate()
        self.opened: dict[Any, float] = {}  # connection -> when it was accepted
        self.opened_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # full: close it, never queue a thread
            self.shutdown_request(request)
            return
        with self.opened_lock:
            self.opened[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.opened_lock:
                self.opened.pop(request, None)
            self.slots.release()

    def cut_overdue(self) -> None:
        """Shuts down connections open past the deadline (their threads then end)."""
        now = time.monotonic()
        with self.opened_lock:
            overdue = [r for r, t in self.opened.items() if now - t > self.deadline_s]
        for request in overdue:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass


class HttpServer:
    """Serves `routes` (path -> WSGI app) to requests that carry an accepted secret.

    Args:
      check: True for an accepted secret (e.g. `same_secret(token)`).
      routes: path -> WSGI app; `/` may be among them (a browser's landing page).
      host: interface to bind (127.0.0.1: this machine only).
      port: port to bind; 0 picks a free one (see `.port`).
      max_connections: connections served at once; more are closed at once.
      deadline_s: a connection is closed this long after it was accepted.
      cookie_secret: what the browser's cookie holds after a login (default: the secret it
        logged in with); `check` must accept it.
    """

    def __init__(
        self,
        check: Callable[[str], bool],
        routes: dict[str, WsgiApp],
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 64,
        deadline_s: float = 15.0,
        cookie_secret: str = "",
    ):
        self.check, self.routes, self.host = check, dict(routes), host
        self.cookie_secret = cookie_secret
        try:
            self._server = wsgiref.simple_server.make_server(
                host, port, self._app, server_class=_Server, handler_class=_Handler
            )
        except OSError as error:
            raise RuntimeError(
                f"cannot serve HTTP on {host}:{port} ({error}): the port is in use or the host "
                "is not an address of this machine; pick another port, or 0 for any free one"
            ) from None
        self._server.slots = threading.BoundedSemaphore(max_connections)
        self._server.deadline_s = deadline_s
        self.port = self._server.server_address[1]
        self.cookie = f"dd_token_{self.port}"  # two runs' pages on one host keep their own
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._cut_overdue, daemon=True)

    def url(self, path: str = "/") -> str:
        """`http://HOST:PORT/path` (the loopback address when bound to every interface)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}{path}"

    def start(self) -> HttpServer:
        """Starts serving in a background thread; returns self."""
        self._thread.start()
        self._watchdog.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def _cut_overdue(self) -> None:
        while not self._stop.wait(1.0):
            self._server.cut_overdue()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [*_TEXT, ("Allow", "GET, HEAD")])
            return [b"405: only GET and HEAD\n"]
        path = environ.get("PATH_INFO", "/")
        try:
            query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), max_num_fields=8)
        except ValueError:  # more fields than any route takes
            start_response("400 Bad Request", _TEXT)
            return [b"400: too many query fields\n"]
        if "token" in query:  # a browser's first visit: the secret becomes a cookie
            secret = query["token"][0]
            if not self.check(secret):
                return self._refuse(start_response)
            value = self.cookie_secret or secret
            cookie = f"{self.cookie}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={_WEEK_S}"
            # Always to the page itself: nothing of the request goes into the header.
            start_response("303 See Other", [("Location", "/"), ("Set-Cookie", cookie)])
            return [b""]
        if not self.check(presented_secret(environ, self.cookie)):
            return self._refuse(start_response)
        app = self.routes.get(path)
        if app is None:
            start_response("404 Not Found", _TEXT)
            return [f"404: no such page; try {', '.join(sorted(self.routes))}\n".encode()]
        return app(environ, start_response)

    @staticmethod
    def _refuse(start_response: Callable[..., Any]) -> Iterable[bytes]:
        start_response("401 Unauthorized", [*_TEXT, ("WWW-Authenticate", "Bearer")])
        return [_REFUSED]


_TEXT = [("Content-Type", "text/plain"), ("X-Content-Type-Options", "nosniff")]
