"""A `trainfit serve` server on a free localhost port for a test module, and JSON requests to it."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainfit.serve.server import make_server


@contextmanager
def running(start_toml: str = "", *, files: tuple[str | Path, ...] = (),
            start_raw: dict[str, Any] | None = None) -> Iterator[str]:
    """The base URL of a server serving in a thread, shut down afterwards (`files`: its --files folders)."""
    server = make_server("127.0.0.1", 0, start_toml, files=files, start_raw=start_raw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def call(base: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, parsed JSON, or the text of a page) of one request."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(text) if kind.startswith("application/json") else text
