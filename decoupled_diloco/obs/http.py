"""A small HTTP server for operators: Prometheus `/metrics` and the job page, behind the token.

Every request must carry the secret the process checks (the run token; a learner process checks
the secret it was given, see `learner.metrics`), before any route runs: an
`Authorization: Bearer SECRET` header (what Prometheus sends with
`authorization: {credentials_file: ...}`), or the `dd_token` cookie that one visit to
`/?token=SECRET` sets (HttpOnly, SameSite=Strict) for a browser. Anything else gets 401; only
GET and HEAD are served. Connections are bounded (`max_connections`, each with a socket
timeout), so that idle or slow clients cannot pile up threads. It binds 127.0.0.1 unless told
otherwise.

  server = HttpServer(lambda s: s == token, {"/metrics": metrics_app(registry)}).start()
"""

from __future__ import annotations

import hmac
import http.cookies
import pathlib
import socketserver
import threading
import urllib.parse
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from typing import Any

import prometheus_client

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
COOKIE = "dd_token"
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


def presented_secret(environ: dict[str, Any]) -> str:
    """The secret a request carries: its bearer token, else its `dd_token` cookie ('' if none)."""
    header = environ.get("HTTP_AUTHORIZATION", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    cookies = http.cookies.SimpleCookie()
    try:
        cookies.load(environ.get("HTTP_COOKIE", ""))
    except http.cookies.CookieError:
        return ""
    return cookies[COOKIE].value if COOKIE in cookies else ""


class _Handler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = 10.0  # a connection that sends nothing is closed after this

    def log_message(self, *args: Any) -> None:  # no line per scrape on stderr
        del args


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted process binds its old port at once
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # full: close it, never queue a thread
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class HttpServer:
    """Serves `routes` (path -> WSGI app) to requests that carry an accepted secret.

    Args:
      check: True for an accepted secret (e.g. `same_secret(token)`).
      routes: path -> WSGI app; `/` may be among them (a browser's landing page).
      host: interface to bind (127.0.0.1: this machine only).
      port: port to bind; 0 picks a free one (see `.port`).
      max_connections: connections served at once; more are closed at once.
    """

    def __init__(
        self,
        check: Callable[[str], bool],
        routes: dict[str, WsgiApp],
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 32,
    ):
        self.check, self.routes, self.host = check, dict(routes), host
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
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str = "/") -> str:
        """`http://HOST:PORT/path` (the loopback address when bound to every interface)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}{path}"

    def start(self) -> HttpServer:
        """Starts serving in a background thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b"405: only GET and HEAD\n"]
        path = environ.get("PATH_INFO", "/")
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), max_num_fields=8)
        if "token" in query:  # a browser's first visit: the secret becomes a cookie
            secret = query["token"][0]
            if not self.check(secret):
                return self._refuse(start_response)
            cookie = f"{COOKIE}={secret}; HttpOnly; SameSite=Strict; Path=/; Max-Age={_WEEK_S}"
            start_response("303 See Other", [("Location", path), ("Set-Cookie", cookie)])
            return [b""]
        if not self.check(presented_secret(environ)):
            return self._refuse(start_response)
        app = self.routes.get(path)
        if app is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"404: no {path[:100]}; try {', '.join(sorted(self.routes))}\n".encode()]
        return app(environ, start_response)

    @staticmethod
    def _refuse(start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")]
        start_response("401 Unauthorized", headers)
        return [_REFUSED]
