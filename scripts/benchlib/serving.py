# SPDX-License-Identifier: Apache-2.0
"""bench-agentic's I/O: ``vllm serve`` processes, HTTP, the /metrics poller,
the multi-turn tool's run. Standard library only (urllib, threads,
subprocess); every process it starts leads its own process group, which is
what it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from . import prom


def http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """(status, text); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def stop_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to the process group this process leads, SIGKILL after
    ``timeout``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)


class Server:
    def __init__(self, arm: str, command: list[str], env: dict, port: int,
                 log_path: Path) -> None:
        self.arm, self.command, self.port = arm, command, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.t_start = time.time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        deadline = self.t_start + timeout
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.arm}: server exited with {self.proc.returncode}: "
                                   f"{self.log_tail(3)}")
            if http(f"{self.url}/health", timeout=2)[0] == 200:
                return time.time() - self.t_start
            time.sleep(1)
        raise TimeoutError(f"{self.arm}: server not ready after {timeout:.0f} s")

    def metrics(self) -> str:
        return http(f"{self.url}/metrics", timeout=10)[1]

    def version(self) -> str | None:
        status, text = http(f"{self.url}/version", timeout=10)
        if status != 200:
            return None
        try:
            return json.loads(text).get("version")
        except (json.JSONDecodeError, AttributeError):
            return text.strip() or None

    def warm(self, sizes: Sequence[int], max_tokens: int = 4) -> list[int]:
        """One short chat request per prompt size, one after another (the
        lazy work of the steps they make out of the measurement: first-use
        setup, and the Triton kernels an eager step of a new size class
        compiles); their HTTP statuses. Each prompt starts with its own
        words, so no warm request is a prefix hit of another."""
        statuses = []
        for n, tokens in enumerate(sizes):
            words = " ".join(f"w{2 + (n * 997 + i) % 8000}" for i in range(tokens))
            body = {"model": "tiny", "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": words}]}
            statuses.append(http(f"{self.url}/v1/chat/completions", body, timeout=120)[0])
        return statuses

    def reset_prefix_cache(self, attempts: int = 20) -> dict:
        """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), retried while
        in-flight work still holds blocks."""
        for i in range(1, attempts + 1):
            status, text = http(f"{self.url}/reset_prefix_cache", {}, timeout=30)
            if status == 200:
                try:
                    ok = bool(json.loads(text).get("success", True))
                except (json.JSONDecodeError, AttributeError):
                    ok = True
                if ok:
                    return {"reset": True, "attempts": i}
            time.sleep(1)
        return {"reset": False, "attempts": attempts, "last_status": status}

    def stop(self) -> None:
        stop_group(self.proc)
        self._log.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            self._log.flush()
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, ValueError):
            return ""


class Poller(threading.Thread):
    """/metrics every ``period`` seconds: [(time, prom.snapshot)]."""

    def __init__(self, server: Server, period: float) -> None:
        super().__init__(daemon=True)
        self.server, self.period = server, period
        self.snaps: list[tuple[float, dict]] = []
        self.errors = 0
        self._halt = threading.Event()

    def poll_once(self) -> None:
        t = time.time()
        text = self.server.metrics()
        if text:
            self.snaps.append((t, prom.snapshot(text)))
        else:
            self.errors += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll_once()
            self._halt.wait(self.period)

    def stop(self) -> list[tuple[float, dict]]:
        self._halt.set()
        self.join(timeout=30)
        self.poll_once()  # the state after the level
        return self.snaps


def run_tool(command: list[str], env: dict, log_path: Path, timeout: float) -> dict:
    """The multi-turn tool in its own process group, killed at ``timeout``."""
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            stop_group(proc, timeout=20)
            rc, timed_out = proc.returncode, True
    return {"rc": rc, "timed_out": timed_out, "wall_s": round(time.time() - t0, 2),
            "t0": t0, "t1": time.time()}


class ProfileWindow(threading.Thread):
    """The engine's torch profiler over part of a level: started ``delay``
    seconds in (the level's load has built up), it stops itself after its
    ``max_iterations`` steps and writes the trace into ``folder``;
    ``finish`` posts /stop_profile (which flushes a window the level cut
    short) and waits for the trace file."""

    def __init__(self, server: Server, folder: Path, delay: float) -> None:
        super().__init__(daemon=True)
        self.server, self.folder, self.delay = server, Path(folder), delay
        self.before = set(self._traces())
        self.started: float | None = None
        self.start_status: int | None = None
        self._halt = threading.Event()

    def _traces(self) -> list[Path]:
        return sorted(self.folder.rglob("*.pt.trace.json*")) if self.folder.is_dir() else []

    def run(self) -> None:
        if self._halt.wait(self.delay):
            return  # the level ended first
        self.started = time.time()
        self.start_status, _ = http(f"{self.server.url}/start_profile", {}, timeout=120)

    def finish(self, wait_s: float = 120.0) -> dict:
        self._halt.set()
        self.join(timeout=150)
        rec: dict = {"delay_s": self.delay, "start_status": self.start_status}
        if self.started is None:
            rec["error"] = "the level ended before the profiler started"
            return rec
        rec["stop_status"], _ = http(f"{self.server.url}/stop_profile", {}, timeout=300)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            new = [p for p in self._traces() if p not in self.before]
            if not new:
                time.sleep(1.0)
                continue
            # the engine's process writes the trace after the window: wait
            # until its size settles
            size = new[-1].stat().st_size
            time.sleep(1.0)
            if new[-1].stat().st_size == size:
                rec["traces"] = [str(p) for p in new]
                return rec
        rec["error"] = f"no finished trace in {self.folder} within {wait_s:.0f} s"
        return rec
