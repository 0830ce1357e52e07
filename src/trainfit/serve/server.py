"""`trainfit serve`'s HTTP side, on the standard library: the page, and JSON in and out of api.py.

Every request is answered: a config error as JSON with its message and field (HTTP 200: the page
shows it beside the field), a request that is not one (malformed JSON, an unknown path, a body over
MAX_BODY, a path the server may not read: serve/files.py) with HTTP 4xx and a message naming what
was wrong, a request from anywhere but the server's own page with 403 (serve/guard.py). A plan runs
in a thread of its own (serve/jobs.py); the page polls it, and asking for another cancels the one
before. Connections are bounded per client and in all, and each has a time limit, so that one client
cannot hold the server."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from trainfit.serve import api
from trainfit.serve.files import FilePolicy, RequestError, log
from trainfit.serve.guard import Guard
from trainfit.serve.jobs import Busy, PlanJobs

MAX_BODY = 2 << 20
"""Bytes of a request body: a config, or a config.json's text (api.MAX_TEXT), with room to spare."""
MAX_CONNECTIONS = 64
"""Connections served at once; more wait to be accepted."""
MAX_CLIENT_CONNECTIONS = 16
"""Connections one client (remote address) may hold at once; more are answered 429 and closed."""
CONNECTION_SECONDS = 30
"""How long a connection may take to send its request (a slow client cannot hold a thread longer)."""


@dataclass
class ServeState:
    """What the server keeps between requests: the config it was started with, the files it may read,
    and the plan jobs."""

    start_toml: str
    folder: Path
    """Where uploaded hardware profiles are kept (hardware.profile names a file)."""
    files: FilePolicy
    guard: Guard
    jobs: PlanJobs = field(init=False)

    def __post_init__(self) -> None:
        self.jobs = PlanJobs(lambda request, progress, stop: api.plan(request, self.files, progress, stop))


def make_handler(state: ServeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "trainfit"
        timeout = CONNECTION_SECONDS

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # quiet: the terminal shows the URL, not every request

        @property
        def client(self) -> str:
            return str(self.client_address[0])

        def _refused(self, method: str, path: str) -> bool:
            refusal = state.guard.refusal(method, path, self.headers)
            if refusal is None:
                return False
            status, why = refusal
            log(f"{status.value} to {self.client} ({method} {path[:80]}): {why}")
            self.close_connection = True
            self._error(status, why)
            return True

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0].split("#", 1)[0]
            if self._refused("GET", path):
                return
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, _page(), "text/html; charset=utf-8")
            elif path == "/api/schema":
                self._json({**api.schema(), "start_toml": state.start_toml})
            elif path.startswith("/api/plan/"):
                asked = path.rsplit("/", 1)[1]
                job = state.jobs.get(self.client, _int(asked))
                if job is None:
                    self._error(HTTPStatus.NOT_FOUND, f"plan {asked[:20]!r}: no such plan (a newer one replaced it, or "
                                "the server restarted); ask again")
                elif job.cancelled:
                    self._json({"state": "cancelled"})
                elif job.failed:
                    self._error(HTTPStatus.BAD_REQUEST, job.failed)
                else:
                    self._json({"state": "done", "answer": job.answer} if job.answer is not None else
                               {"state": "running", "progress": job.progress})
            else:
                self._error(HTTPStatus.NOT_FOUND, f"{path[:80]!r}: no such page; the app is at /")

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if self._refused("POST", path):
                return
            files = state.files
            routes = {"/api/estimate": lambda r: api.estimate(r, files),
                      "/api/hf-config": lambda r: api.hf_config(r.get("config_json")),
                      "/api/toml": lambda r: {"toml": api.toml(r, files)},
                      "/api/plan": lambda r: {"job": state.jobs.start(self.client, r)},
                      "/api/plan-cancel": lambda r: state.jobs.cancel(self.client),
                      "/api/profile": lambda r: api.hardware_profile(r.get("profile_toml"), state.folder)}
            if path not in routes:
                self._error(HTTPStatus.NOT_FOUND, f"{path[:80]!r}: no such request; POST to one of {', '.join(routes)}")
                return
            request = self._body()
            if request is None:
                return
            try:
                self._json(routes[path](request))
            except Busy as err:
                self._error(HTTPStatus.TOO_MANY_REQUESTS, str(err))
            except RequestError as err:
                self._error(HTTPStatus.BAD_REQUEST, str(err), err.field)
            except api.ConfigError as err:  # /api/toml: a config that does not validate
                self._json(api.error_answer(err))
            except Exception as err:  # noqa: BLE001 - a bug: a 500 with its name, never a dropped connection
                traceback.print_exc()
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error ({type(err).__name__}); please report "
                            "it with the config (the server's terminal has the details)")

        def _not_allowed(self) -> None:
            self.close_connection = True
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command[:20]}: the server answers GET and POST only",
                        headers={"Allow": "GET, POST"})

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = do_CONNECT = _not_allowed  # noqa: N815

        def _body(self) -> dict[str, Any] | None:
            """The request's JSON object, or None after answering why not."""
            length = _int(self.headers.get("Content-Length", ""))
            if length is None or length < 0:
                self.close_connection = True
                self._error(HTTPStatus.LENGTH_REQUIRED, "a request needs a Content-Length header")
                return None
            if length > MAX_BODY:
                self.close_connection = True  # the body is not read: nothing else on this connection
                self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request of {length:,} bytes: at most "
                            f"{MAX_BODY:,}; a config or a config.json is a few KiB")
                return None
            try:
                request = json.loads(self.rfile.read(length) or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                self._error(HTTPStatus.BAD_REQUEST, f"request body: not JSON ({err}); send a JSON object")
                return None
            except RecursionError:
                self._error(HTTPStatus.BAD_REQUEST, "request body: JSON nested too deep; send a flat object")
                return None
            if not isinstance(request, dict):
                self._error(HTTPStatus.BAD_REQUEST, f"request body: a JSON {type(request).__name__}; send an object")
                return None
            return request

        def _json(self, payload: Any) -> None:
            self._send(HTTPStatus.OK, json.dumps(_finite(payload), allow_nan=False).encode(), "application/json")

        def _error(self, status: HTTPStatus, message: str, field_name: str | None = None,
                   headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps({"error": message, "field": field_name}).encode(), "application/json",
                       headers)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None
                  ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "frame-ancestors 'none'")  # no page of another site frames it
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def _finite(value: Any) -> Any:
    """`value` with infinite and NaN floats as the strings "inf", "-inf", "nan": JSON has no such numbers
    (Python writes Infinity, which a browser's JSON.parse refuses)."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _page() -> bytes:
    return resources.files("trainfit.serve").joinpath("page.html").read_bytes()


class Server(ThreadingHTTPServer):
    """The HTTP server: bounded connections, and its folder of uploaded profiles removed when closed."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], state: ServeState) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, make_handler(state))
        self.state = state
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.per_client: Counter[str] = Counter()
        self.count_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0])
        with self.count_lock:
            crowded = self.per_client[client] >= MAX_CLIENT_CONNECTIONS
            if not crowded:
                self.per_client[client] += 1
        if crowded:
            _refuse_crowded(request)
            self.shutdown_request(request)
            return
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(str(client_address[0]))

    def _done(self, client: str) -> None:
        with self.count_lock:
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]
        self.slots.release()

    def server_close(self) -> None:
        super().server_close()
        shutil.rmtree(self.state.folder, ignore_errors=True)


def _refuse_crowded(sock: socket.socket) -> None:
    body = json.dumps({"error": f"more than {MAX_CLIENT_CONNECTIONS} connections at once from one address; wait for "
                       "the answers before asking again", "field": None}).encode()
    try:
        sock.settimeout(1)
        sock.sendall(b"HTTP/1.0 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    except OSError:
        pass


def make_server(host: str, port: int, start_toml: str = "", *, files: tuple[str | Path, ...] = (),
                start_raw: dict[str, Any] | None = None) -> Server:
    """The server (not yet serving); port 0 picks a free one (server.server_address has it). `files`:
    the folders whose files requests may name (serve/files.py); `start_raw`: the start config's tables,
    whose own files requests may name too."""
    folder = Path(tempfile.mkdtemp(prefix="trainfit-serve-"))
    try:
        state = ServeState(start_toml, folder, FilePolicy.of(files, start_raw or {}, folder), Guard.of(host))
        return Server((host, port), state)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
