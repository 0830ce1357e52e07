"""How tests start the processes of a gloo world: forked from multiprocessing's fork server, not
spawned. The server is one process per session that imports torch and trainfit once (FORK_SERVER_PRELOAD)
and forks each rank from that state; a spawned rank is a fresh interpreter that imports them again
(7-20 s per start on 2 busy cores, more than many tests' own work). A rank is as clean as a spawned
one: the server runs no test, holds no process group and no tensor of the caller's (a plain fork of
pytest's process would copy its DTensor caches, which resolved stale process groups). Ranks inherit
the server's environment, so each is given the caller's."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

from _fp8_flops import counted_rank

FORK_SERVER_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "trainfit.train.trainer"]
"""What the fork server imports before it forks any rank (the tests' heavy imports)."""


def rank_context(*preload: str) -> multiprocessing.context.BaseContext:
    """The "forkserver" context, its server to import FORK_SERVER_PRELOAD and `preload` (modules by
    name) when it starts: at the session's first start of a rank, so the first caller's list counts."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*FORK_SERVER_PRELOAD, *preload])
    return context


def start_ranks(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run `fn(rank, *args)` in `nprocs` processes forked from the fork server, each with this
    process's environment, and wait for them (torch.multiprocessing.start_processes: a rank's
    exception is raised here). `fn` must be a module-level function."""
    rank_context()
    torch.multiprocessing.start_processes(with_environment, args=(dict(os.environ), fn, args), nprocs=nprocs,
                                          start_method="forkserver")


def with_environment(rank: int, environ: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    """`fn(rank, *args)` in the environment `environ` (a rank forked from the server has the server's),
    its fp8 work counted for the test that started it (tests/_fp8_flops.py)."""
    os.environ.clear()
    os.environ.update(environ)
    with counted_rank():
        fn(rank, *args)
