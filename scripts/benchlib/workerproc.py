# SPDX-License-Identifier: Apache-2.0
"""The parent's handle on a bench-tax engine process (engine_worker): start
it, send JSON commands, read JSON replies with deadlines, stop it.

Every engine is its own process, so engines of both arms are alive side by
side on one GPU (small ``gpu_memory_utilization``, fixed KV bytes) and the
arms can alternate sample by sample; an idle engine does no GPU work (an
in-process LLM steps only inside generate()).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path


class EngineError(RuntimeError):
    """The engine answered with an error, died, or did not answer in time."""


class EngineProcess:
    def __init__(self, key: str, spec: dict, env: dict, log_path: Path,
                 command: list[str] | None = None, cwd: Path | None = None) -> None:
        self.key, self.log_path = key, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        cmd = command or [sys.executable, "-m", "benchlib.engine_worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, cwd=cwd)
        self._buf = b""
        self.info: dict | None = None
        self.error: str | None = None
        self._write({**spec, "key": key})

    # -------------------------------------------------------------- I/O

    def _write(self, obj: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise EngineError(f"{self.key}: engine process gone ({err!r}); "
                              f"log: {self.log_tail()}") from None

    def _readline(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.time()
            if left <= 0:
                raise EngineError(f"{self.key}: no answer within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait(timeout=30)
                raise EngineError(f"{self.key}: engine process exited "
                                  f"({self.proc.returncode}); log: {self.log_tail()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def wait_ready(self, timeout: float) -> dict:
        reply = self._readline(timeout)
        if not reply.get("ok"):
            self.error = reply.get("error", "?")
            raise EngineError(f"{self.key}: engine did not start: {last_line(self.error)}")
        self.info = {k: v for k, v in reply.items() if k != "ok"}
        return self.info

    def call(self, op: str, timeout: float = 300.0, **args) -> dict:
        self._write({"op": op, **args})
        reply = self._readline(timeout)
        if not reply.get("ok"):
            raise EngineError(f"{self.key}: {op} failed: {last_line(reply.get('error', '?'))}")
        return {k: v for k, v in reply.items() if k != "ok"}

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout=timeout)
            except EngineError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            self._log.flush()
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def last_line(text: str) -> str:
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else str(text)
