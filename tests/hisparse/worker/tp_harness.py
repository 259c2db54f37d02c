# SPDX-License-Identifier: Apache-2.0
"""TP ranks as real OS processes for the shared host pool tests (spec 4.12).

``run_ranks`` forks one process per rank; each joins a gloo process group
(the same CPU collectives vLLM's TP group uses) and runs the test's function
with a ``ProcessGroupRendezvous`` over it. The ranks share a real file
mapping, so what one rank writes the others read through their own views.
Outcomes (a value, or the exception's type and message, or the signal that
killed the process) come back to the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """What one rank's process ended with."""

    rank: int
    value: Any = None
    error: str | None = None
    """Exception type name, or None."""
    message: str = ""
    exitcode: int | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank {self.rank}: {self.error}: {self.message}")
        return self.value


def run_ranks(
    world: int,
    target: Callable[..., Any],
    *args: Any,
    store_dir: Path,
    timeout_s: float = 120.0,
    method: str = "fork",
) -> list[Outcome]:
    """``target(rank, rendezvous, *args)`` on ``world`` processes: forked
    (CPU tests), or spawned (CUDA: ``target`` must be importable)."""
    ctx = mp.get_context(method)
    results = ctx.Queue()
    init = f"file://{store_dir}/gloo-{uuid.uuid4().hex}"
    procs = [
        ctx.Process(target=_child, args=(rank, world, init, results, target, args))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                outcome = results.get(timeout=0.2)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break  # a rank died without reporting
                continue
            outcomes[outcome.rank] = outcome
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    for rank, proc in enumerate(procs):
        outcome = outcomes.setdefault(
            rank, Outcome(rank, error="NoResult", message="the process ended silently")
        )
        outcome.exitcode = proc.exitcode
    return [outcomes[r] for r in range(world)]


def _child(rank, world, init, results, target, args) -> None:
    try:
        import torch
        import torch.distributed as dist

        from vllm.v1.hisparse.tp_shared import ProcessGroupRendezvous

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world,
            timeout=timedelta(seconds=60),
        )
        rdv = ProcessGroupRendezvous(dist.group.WORLD)
        results.put(Outcome(rank, value=target(rank, rdv, *args)))
    except BaseException as err:  # noqa: BLE001 - report everything
        results.put(Outcome(
            rank, error=type(err).__name__,
            message=f"{err}\n{traceback.format_exc()}",
        ))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip the parent's (pytest's) exit handlers


def in_child(fn: Callable[[], Any], timeout_s: float = 60.0) -> int:
    """Run ``fn`` in a forked process; its exit code (negative: a signal)."""
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_run_and_exit, args=(fn,))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


def _run_and_exit(fn) -> None:
    try:
        fn()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def shm_directory() -> Path:
    """A fresh directory on the real tmpfs (``/dev/shm``) when there is one,
    so the tests exercise the file system production uses."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="hisparse-test-", dir=base))


PREFIX = "vllm-hisparse-"


def region_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(PREFIX))


def mapped_regions() -> list[str]:
    """This process's mappings of HiSparse region files (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if PREFIX in line]


def remove_directory(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
