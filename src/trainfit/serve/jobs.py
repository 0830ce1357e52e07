"""The web page's plans, each in a thread of its own, bounded so that no client starves the others:
one plan per client at a time (asking for another cancels its last), at most `max_running` plans
across clients (more are refused until one ends), each stopped after `seconds`, and the answers of
the `max_clients` latest clients kept. A client is a remote address."""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainfit.serve.files import RequestError

MAX_RUNNING = 4
"""Plans running at once, all clients together (a plan keeps one core busy while it runs)."""
PLAN_SECONDS = 600.0
"""How long one plan may run before the server stops it (the command line has no such limit)."""
MAX_CLIENTS = 64
"""Clients whose latest plan is kept for polling."""


class Busy(RequestError):
    """Every plan slot is taken by other clients' plans: answered with HTTP 429."""


@dataclass
class PlanJob:
    """One plan question, answered in its own thread."""

    deadline: float
    progress: str = "starting"
    answer: dict[str, Any] | None = None
    cancelled: bool = False
    failed: str = ""
    timed_out: bool = False

    @property
    def running(self) -> bool:
        return self.answer is None and not self.cancelled and not self.failed

    def stop(self) -> bool:
        """Whether the plan should stop now: cancelled, or past its deadline (then marked so)."""
        if not self.cancelled and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.cancelled or self.timed_out


Plan = Callable[[dict[str, Any], Callable[[str], None], Callable[[], bool]], dict[str, Any]]
"""(request, progress, stop) -> the plan's answer; raises Cancelled when stop() says so."""


@dataclass
class PlanJobs:
    run: Plan
    max_running: int = MAX_RUNNING
    seconds: float = PLAN_SECONDS
    max_clients: int = MAX_CLIENTS
    jobs: OrderedDict[str, tuple[int, PlanJob]] = field(default_factory=OrderedDict)
    """Each client's latest plan (id, job), least recently asked first."""
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, client: str, request: dict[str, Any]) -> int:
        """Cancel the client's running plan and start this one; its id. Busy when every slot is taken."""
        with self.lock:
            self._cancel(client)
            running = sum(job.running for _, job in self.jobs.values())
            if running >= self.max_running:
                raise Busy(f"the server is answering {running} plans for other pages, its most at once; ask again "
                           "when one has finished, or run `trainfit plan` at the command line")
            job_id = next(self.ids)
            job = PlanJob(time.monotonic() + self.seconds)
            self.jobs.pop(client, None)
            self.jobs[client] = (job_id, job)
            while len(self.jobs) > self.max_clients:
                _, (_, oldest) = self.jobs.popitem(last=False)
                oldest.cancelled = True
        threading.Thread(target=self._answer, args=(job, request), daemon=True, name=f"plan-{job_id}").start()
        return job_id

    def get(self, client: str, job_id: int | None) -> PlanJob | None:
        """The client's plan of that id (another client's plans are not its to see)."""
        with self.lock:
            latest = self.jobs.get(client)
        return latest[1] if latest is not None and latest[0] == job_id else None

    def cancel(self, client: str) -> dict[str, int]:
        """Cancel the client's running plan (the page changed the config under it); how many were running."""
        with self.lock:
            return {"cancelled": self._cancel(client)}

    def _cancel(self, client: str) -> int:
        latest = self.jobs.get(client)
        if latest is None or not latest[1].running:
            return 0
        latest[1].cancelled = True
        return 1

    def _answer(self, job: PlanJob, request: dict[str, Any]) -> None:
        from trainfit.plan.answer import Cancelled

        def progress(what: str) -> None:
            job.progress = what

        try:
            job.answer = self.run(request, progress, job.stop)
        except Cancelled:
            if job.timed_out:
                job.failed = (f"the plan ran past {self.seconds:.0f} s, this server's limit for one plan; fix more "
                              "fields (the degrees, the micro-batch) to search fewer layouts, or run `trainfit plan` "
                              "at the command line, which has no limit")
            else:
                job.cancelled = True
        except RequestError as err:
            job.failed = str(err)
        except Exception as err:  # noqa: BLE001 - a bug: said on the page and in the log, never a dead job
            traceback.print_exc()
            job.failed = f"internal error ({type(err).__name__}); please report it with the config"
