# SPDX-License-Identifier: Apache-2.0
"""Where an engine's host time goes, without the torch profiler: py-spy
samples a server's engine-core process over a level (bench-agentic
--sample-engines). The torch profiler inflates a host-bound step several-
fold and sees only torch ops; a sampler reading the process from outside
(--nonblocking: the engine is never stopped) sees every Python frame at
the engine's own speed.

A sample file is py-spy's raw (collapsed) format: one line per distinct
stack, ``frame;frame;...;frame COUNT``, root first, each frame
``function (file:line)``; with --threads the first frame names the thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

# vLLM titles its engine-core process (setproctitle) "VLLM::EngineCore":
# the title replaces the command line's first argument.
ENGINE_MARK = b"EngineCore"
STOP_TIMEOUT_S = 60.0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def engine_pids(root: int) -> list[int]:
    """The engine-core processes below ``root`` (a `vllm serve`)."""
    found, todo = [], [root]
    while todo:
        for child in _children(todo.pop()):
            todo.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if ENGINE_MARK in cmdline.split(b"\0", 1)[0]:  # its title, not an argument
                found.append(child)
    return sorted(found)


class Sampler:
    """py-spy over one process from start() to stop(): its collapsed
    stacks in ``path``."""

    def __init__(self, pyspy: str, pid: int, path: Path, rate: int) -> None:
        self.pid, self.path = pid, Path(path)
        self.command = [pyspy, "record", "--pid", str(pid), "--nonblocking",
                        "--threads", "--rate", str(rate), "--format", "raw",
                        "--output", str(self.path)]
        self.log = self.path.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> dict:
        """SIGINT makes py-spy write what it sampled and exit."""
        rec = {"pid": self.pid, "command": " ".join(self.command)}
        if self.proc is None:
            return {**rec, "error": "not started"}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rec["rc"] = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rec["rc"] = self.proc.wait()
        if not self.path.exists():
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            rec["error"] = "py-spy wrote nothing: " + " | ".join(tail)
        return rec


def _frame_key(frame: str) -> str:
    """``function (file:line)`` -> ``function (file)``: lines of one
    function add up; the file is cut to its last three parts."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    short = "/".join(path.split("/")[-3:])
    return f"{name} ({short})" if short else name


def parse(text: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks.append((stack.split(";"), int(count)))
    return stacks


def summarize(path: Path, top: int = 40, marks: tuple[str, ...] = ()) -> dict:
    """Per thread, samples; for the busiest thread, the ``top`` functions
    by inclusive and by self share of its samples, and the share of the
    samples whose stack passes through each of ``marks`` (substrings of a
    frame)."""
    stacks = parse(Path(path).read_text(errors="replace"))
    by_thread: Counter = Counter()
    for frames, n in stacks:
        by_thread[frames[0]] += n
    if not by_thread:
        return {"samples": 0}
    main, total = by_thread.most_common(1)[0]
    inclusive: Counter = Counter()
    own: Counter = Counter()
    marked: Counter = Counter()
    for frames, n in stacks:
        if frames[0] != main:
            continue
        body = frames[1:]
        for key in {_frame_key(f) for f in body}:
            inclusive[key] += n
        if body:
            own[_frame_key(body[-1])] += n
        for m in marks:
            if any(m in f for f in body):
                marked[m] += n

    def shares(c: Counter) -> list[list]:
        return [[k, round(v / total, 4)] for k, v in c.most_common(top)]

    return {"samples": sum(by_thread.values()), "threads": dict(by_thread.most_common(8)),
            "main_thread": main, "main_samples": total,
            "inclusive": shares(inclusive), "self": shares(own),
            "marks": {m: round(marked[m] / total, 4) for m in marks}}
