"""Only the server's own page may ask it: another site's page (a form post, a request for an answer)
and a page that re-points its own name at this machine (DNS rebinding) get 403; a client's plans
are its own and bounded, so no client can starve the others."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from _server import call, running
from trainfit.serve import api
from trainfit.serve.files import FilePolicy
from trainfit.serve.guard import Guard
from trainfit.serve.jobs import Busy, PlanJobs

VALUES = {"values": {"model.preset": "debug"}, "fixes": False}
SLOW = {"values": {"model.preset": "llama3-70b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "512"},
        "plan": {"tokens": "1e12", "gpu_options": "H100-SXM-80GB,A100-SXM-80GB,L4", "max_gpus": "512"}}


@pytest.fixture(scope="module")
def base():
    with running() as url:
        yield url


def port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


@pytest.mark.parametrize(("headers", "status"), [
    ({"Host": "evil.example:8000"}, 403),  # DNS rebinding: the page's own name, pointed here
    ({"Host": "127.0.0.1.evil.example"}, 403),
    ({"Origin": "http://evil.example"}, 403),  # another site's page
    ({"Origin": "null"}, 403),  # a sandboxed frame or a file:// page
    ({"Sec-Fetch-Site": "cross-site"}, 403),
    ({"Sec-Fetch-Site": "same-site"}, 403),  # another port of localhost is another site's page too
    ({"Content-Type": "application/x-www-form-urlencoded"}, 403),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 403),
    ({"Content-Type": "text/plain"}, 403),
    ({"Content-Type": "application/xml"}, 415),
    ({"Sec-Fetch-Site": "same-origin"}, 200),
    ({"Content-Type": "application/json; charset=utf-8"}, 200),
])
def test_a_request_from_elsewhere_than_the_page_is_refused(base, headers, status) -> None:
    got, answer = call(base, "POST", "/api/estimate", VALUES, headers=headers)
    assert got == status, answer
    if status != 200:
        assert answer["error"] and "Traceback" not in answer["error"]


def test_the_page_and_its_own_origin_are_answered_on_every_loopback_name(base) -> None:
    for host in (f"localhost:{port(base)}", f"127.0.0.1:{port(base)}", "LOCALHOST", f"127.0.0.2:{port(base)}"):
        assert call(base, "GET", "/api/schema", headers={"Host": host})[0] == 200, host
        status, _ = call(base, "POST", "/api/estimate", VALUES, headers={"Host": host, "Origin": f"http://{host}"})
        assert status == 200, host
    # the page itself may be opened from a link on another site; its answers may not
    assert call(base, "GET", "/", headers={"Sec-Fetch-Site": "cross-site"})[0] == 200
    assert call(base, "GET", "/api/schema", headers={"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert call(base, "GET", "/api/schema", headers={"Host": "evil.example"})[0] == 403


def test_a_request_without_a_host_and_other_methods_get_a_4xx(base) -> None:
    with socket.create_connection(("127.0.0.1", port(base)), timeout=30) as s:
        s.sendall(b"GET /api/schema HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 403")
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH"):
        status, answer = call(base, method, "/api/estimate", VALUES)
        assert status == 405 and "GET and POST" in answer["error"]


def test_a_server_on_every_address_answers_its_ip_addresses_and_names_but_no_other_name() -> None:
    everywhere = Guard.of("0.0.0.0")
    assert everywhere.host_allowed("10.1.2.3:8000") and everywhere.host_allowed("[fe80::1]:8000")
    assert everywhere.host_allowed(socket.gethostname()) and everywhere.host_allowed("localhost")
    assert not everywhere.host_allowed("evil.example") and not everywhere.host_allowed(None)
    one = Guard.of("192.168.1.5")
    assert one.host_allowed("192.168.1.5:8000") and not one.host_allowed("10.1.2.3")


def from_address(base: str, source: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A request from another loopback address: another client of the same server."""
    conn = http.client.HTTPConnection("127.0.0.1", port(base), timeout=60, source_address=(source, 0))
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer


def test_one_clients_plan_is_neither_cancelled_nor_seen_by_another(base) -> None:
    mine = call(base, "POST", "/api/plan", SLOW)[1]["job"]
    status, theirs = from_address(base, "127.0.0.2", "POST", "/api/plan", {"values": {"model.preset": "debug"}})
    assert status == 200
    assert _finished(base, "127.0.0.2", theirs["job"]) == "done"
    assert call(base, "GET", f"/api/plan/{mine}")[1]["state"] == "running"  # not cancelled by theirs
    assert from_address(base, "127.0.0.2", "GET", f"/api/plan/{mine}")[0] == 404  # nor theirs to see
    assert from_address(base, "127.0.0.2", "POST", "/api/plan-cancel", {})[1] == {"cancelled": 0}
    assert call(base, "POST", "/api/plan-cancel", {})[1] == {"cancelled": 1}
    assert _finished(base, "127.0.0.1", mine) == "cancelled"


def _finished(base: str, source: str, job: int) -> str:
    for _ in range(1200):
        status, answer = from_address(base, source, "GET", f"/api/plan/{job}")
        assert status == 200, answer
        if answer["state"] != "running":
            return answer["state"]
        time.sleep(0.1)
    raise AssertionError("the plan did not finish in 120 s")


def test_plans_are_bounded_in_number_and_time() -> None:
    jobs = PlanJobs(lambda request, progress, stop: api.plan(request, FilePolicy(), progress, stop),
                    max_running=2, seconds=1.0)
    first, second = jobs.start("a", SLOW), jobs.start("b", SLOW)
    with pytest.raises(Busy, match="its most at once"):
        jobs.start("c", SLOW)
    again = jobs.start("a", SLOW)  # a client's new plan takes its own old one's place
    assert jobs.get("a", first) is None and jobs.get("a", again) is not None and jobs.get("b", second) is not None
    deadline = time.monotonic() + 120
    while any(jobs.get(c, j).running for c, j in (("a", again), ("b", second))) and time.monotonic() < deadline:
        time.sleep(0.05)
    for client, job in (("a", again), ("b", second)):
        assert "ran past 1 s" in jobs.get(client, job).failed
    assert jobs.start("c", {"values": {"model.preset": "debug"}})  # the slots are free again
