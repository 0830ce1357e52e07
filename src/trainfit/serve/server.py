"""`trainfit serve`'s HTTP side, on the standard library: the page, and JSON in and out of api.py.

Every request is answered: a config error as JSON with its message and field (HTTP 200: the page
shows it beside the field), a request that is not one (malformed JSON, an unknown path, a body over
MAX_BODY) with HTTP 4xx and a message naming what was wrong. A plan runs in a thread of its own; the
page polls it, and asking for another plan cancels the one before."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from trainfit.serve import api

MAX_BODY = 2 << 20
"""Bytes of a request body: a config, or a config.json's text (api.MAX_TEXT), with room to spare."""


@dataclass
class PlanJob:
    """One plan question, answered in its own thread."""

    progress: str = "starting"
    answer: dict[str, Any] | None = None
    cancelled: bool = False
    failed: str = ""


@dataclass
class ServeState:
    """What the server keeps between requests: the config it was started with and the plan jobs."""

    start_toml: str = ""
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="trainfit-serve-")))
    """Where uploaded hardware profiles are kept (hardware.profile names a file)."""
    jobs: dict[int, PlanJob] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel_plans(self) -> dict[str, int]:
        """Cancel every running plan (the page changed the config under it); how many were running."""
        with self.lock:
            running = [job for job in self.jobs.values() if job.answer is None and not job.cancelled]
            for job in running:
                job.cancelled = True
        return {"cancelled": len(running)}

    def start_plan(self, request: dict[str, Any]) -> int:
        """Cancel every running plan, start this one; its id."""
        job = PlanJob()
        self.cancel_plans()
        with self.lock:
            job_id = next(self.ids)
            self.jobs = {job_id: job}  # the page polls the newest only
        threading.Thread(target=self._run, args=(job, request), daemon=True).start()
        return job_id

    @staticmethod
    def _run(job: PlanJob, request: dict[str, Any]) -> None:
        from trainfit.plan.answer import Cancelled

        def progress(what: str) -> None:
            job.progress = what

        try:
            job.answer = api.plan(request, progress=progress, cancelled=lambda: job.cancelled)
        except Cancelled:
            job.cancelled = True
        except api.RequestError as err:
            job.failed = str(err)
        except Exception as err:  # noqa: BLE001 - a bug: said on the page and in the log, never a dead job
            traceback.print_exc()
            job.failed = f"internal error ({type(err).__name__}: {err}); please report it"


def make_handler(state: ServeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "trainfit"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # quiet: the terminal shows the URL, not every request

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0].split("#", 1)[0]
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, _page(), "text/html; charset=utf-8")
            elif path == "/api/schema":
                self._json({**api.schema(), "start_toml": state.start_toml})
            elif path.startswith("/api/plan/"):
                job = state.jobs.get(_int(path.rsplit("/", 1)[1]))
                if job is None:
                    self._error(HTTPStatus.NOT_FOUND, f"plan {path.rsplit('/', 1)[1][:20]!r}: no such plan (a newer "
                                "one replaced it, or the server restarted); ask again")
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
            routes = {"/api/estimate": api.estimate, "/api/hf-config": lambda r: api.hf_config(r.get("config_json")),
                      "/api/toml": lambda r: {"toml": api.toml(r)},
                      "/api/plan": lambda r: {"job": state.start_plan(r)},
                      "/api/plan-cancel": lambda r: state.cancel_plans(),
                      "/api/profile": lambda r: api.hardware_profile(r.get("profile_toml"), state.folder)}
            if path not in routes:
                self._error(HTTPStatus.NOT_FOUND, f"{path[:80]!r}: no such request; POST to one of {', '.join(routes)}")
                return
            request = self._body()
            if request is None:
                return
            try:
                self._json(routes[path](request))
            except api.RequestError as err:
                self._error(HTTPStatus.BAD_REQUEST, str(err))
            except api.ConfigError as err:  # /api/toml: a config that does not validate
                self._json(api.error_answer(err))
            except Exception as err:  # noqa: BLE001 - a bug: a 500 with its name, never a dropped connection
                traceback.print_exc()
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error ({type(err).__name__}: {err}); "
                            "please report it with the config")

        def _body(self) -> dict[str, Any] | None:
            """The request's JSON object, or None after answering why not."""
            length = _int(self.headers.get("Content-Length", ""))
            if length is None or length < 0:
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
            if not isinstance(request, dict):
                self._error(HTTPStatus.BAD_REQUEST, f"request body: a JSON {type(request).__name__}; send an object")
                return None
            return request

        def _json(self, payload: Any) -> None:
            self._send(HTTPStatus.OK, json.dumps(_finite(payload), allow_nan=False).encode(), "application/json")

        def _error(self, status: HTTPStatus, message: str) -> None:
            self._send(status, json.dumps({"error": message, "field": None}).encode(), "application/json")

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
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
    """The HTTP server, which removes its folder of uploaded profiles when closed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: ServeState) -> None:
        super().__init__(address, make_handler(state))
        self.state = state

    def server_close(self) -> None:
        super().server_close()
        shutil.rmtree(self.state.folder, ignore_errors=True)


def make_server(host: str, port: int, start_toml: str = "") -> Server:
    """The server (not yet serving); port 0 picks a free one (server.server_address has it)."""
    state = ServeState(start_toml)
    try:
        return Server((host, port), state)
    except OSError:
        shutil.rmtree(state.folder, ignore_errors=True)
        raise
