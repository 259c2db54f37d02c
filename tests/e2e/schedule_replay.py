# SPDX-License-Identifier: Apache-2.0
"""Record an engine's schedule and make another engine follow it (the e2e
gate's replay arm, docs/worker.md K28).

vLLM's kernels are not batch-invariant: a request's logits depend on what
else ran in its steps (GEMM tiles, FlashMLA's split-KV plan, MoE blocks),
and on a context-sensitive model that flips greedy tokens (run 9,
results/e2e/README.md). HiSparse under pressure schedules differently from
HiSparse off by design (it defers an admission, waits a step for an
in-flight copy, hits a shorter host prefix), so a comparison with the off
arm's own schedule cannot be bitwise. The replay arm is a HiSparse-off
engine whose scheduler takes, step by step, exactly the requests and token
counts the HiSparse engine's scheduler took, and the prefix-hit length
each request had at admission: then both arms run the same batches, and
every logprob must be equal bit for bit.

``ScheduleTap`` wraps one in-process scheduler (``EngineCore.scheduler``):

- it records, for every step that scheduled tokens, ``[key, tokens,
  computed]`` per request in the scheduler's order, where ``key`` names the
  request in the scenario (``"call/conversation"``) and ``computed`` is the
  number of tokens it already had when admitted or resumed in this step
  (prefix hit plus external tokens), or -1 for a request already running;
  and ``[key, 0, PREEMPTED]`` first for every request preempted since the
  previous step (HiSparse preempts on host exhaustion, E2E-9);
- in replay, before each ``schedule()`` it hides every running and waiting
  request the recorded step does not name, puts the named running ones in
  the recorded order, sets the step's token budget to the recorded total,
  caps each admission's prefix hit at the recorded ``computed`` and
  preempts what the recorded step preempted; it restores the queues and the
  budget afterwards. The replayed steps are
  recorded like any other, so the comparison checks that the replay
  reproduced the schedule; where it could not, ``diverged`` says where.

Test-only: it touches scheduler attributes (``running``, ``waiting``,
``skipped_waiting``, ``max_num_scheduled_tokens``,
``kv_cache_manager.get_computed_blocks``) of the pinned vLLM 0.26.0.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

Step = list[list]
"""One recorded step: [[key, num_scheduled_tokens, computed_at_admission]]."""
PREEMPTED = -2
"""``computed`` of a step entry that records a preemption (0 tokens)."""


def step_counts(step: Sequence[Sequence]) -> list[int]:
    """A keyed step as the unkeyed trace of e2e_compare.trace_step."""
    return sorted(int(n) for _, n, _ in step if n)


class ScheduleTap:
    STALL_LIMIT = 1000
    """Consecutive paced calls that scheduled nothing before the replay
    gives up (the wanted requests never became schedulable)."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.keys: dict[str, str] = {}
        """Internal request id -> the scenario's key of the request."""
        self.ids: dict[str, str] = {}
        self.steps: list[Step] = []
        self.plan: deque[Step] | None = None
        self.diverged: dict | None = None
        self.caps: dict[str, int] = {}
        self.stalls = 0
        self.preempted: list[str] = []
        """Requests preempted since the last recorded step."""
        self._schedule = scheduler.schedule
        scheduler.schedule = self.schedule
        self._preempt = scheduler._preempt_request
        scheduler._preempt_request = self.preempt_request
        manager = getattr(scheduler, "kv_cache_manager", None)
        self._computed = getattr(manager, "get_computed_blocks", None)
        if self._computed is not None:
            manager.get_computed_blocks = self.get_computed_blocks

    # ------------------------------------------------------------ control

    def start(self, plan: Sequence[Step] | None = None) -> None:
        """A new scenario: recording only (``plan`` None) or replaying
        ``plan`` (the recorded steps of another engine)."""
        self.keys, self.ids, self.steps = {}, {}, []
        self.plan = None if plan is None else deque(plan)
        self.diverged, self.stalls, self.preempted = None, 0, []

    def name(self, request_id: str, key: str) -> None:
        """Give a request (internal id) its scenario key, before it runs."""
        self.keys[request_id] = key
        self.ids[key] = request_id

    def finish(self) -> dict | None:
        """End of a replayed scenario: steps left over are a divergence."""
        if self.plan and self.diverged is None:
            self._diverge({"left_over": len(self.plan), "wanted": self.plan[0]})
        return self.diverged

    # ---------------------------------------------------------- the hooks

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        want = self.plan[0] if self.plan else None
        if want is None:
            out = self._schedule(*args, **kwargs)
        else:
            out = self._paced(want, args, kwargs)
        step = self._record(out)
        if want is not None:
            self._consume(want, step)
        return out

    def preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.preempted.append(request.request_id)
        return self._preempt(request, *args, **kwargs)

    def get_computed_blocks(self, request: Any) -> Any:
        """vLLM's (blocks, computed tokens, shared-prefix boundary), the hit
        cut to the recorded length of a replayed admission."""
        blocks, computed, boundary = self._computed(request)
        cap = self.caps.get(request.request_id)
        if cap is None or computed <= cap:
            return blocks, computed, boundary
        n = cap // self.sched.block_size
        tokens = n * self.sched.block_size
        return _truncated(blocks, n), tokens, min(boundary, tokens)

    # ------------------------------------------------------------ details

    def _record(self, out: Any) -> Step | None:
        admitted = _admitted(out)
        step = [[self.keys.get(rid, rid), int(n), int(admitted.get(rid, -1))]
                for rid, n in out.num_scheduled_tokens.items() if n]
        if not step:
            return None
        step = [[self.keys.get(rid, rid), 0, PREEMPTED] for rid in self.preempted] + step
        self.preempted = []
        self.steps.append(step)
        return step

    def _consume(self, want: Step, step: Step | None) -> None:
        """A paced call that scheduled nothing leaves the wanted step for
        the next call (the engine may call between a call's last forward and
        the next call's requests); one that scheduled anything consumes it."""
        if step is None:
            self.stalls += 1
            if self.stalls >= self.STALL_LIMIT:
                self._diverge({"stalled": self.stalls, "wanted": want})
            return
        self.stalls = 0
        self.plan.popleft()
        if step != want:
            self._diverge({"wanted": want, "got": step})

    def _diverge(self, what: dict) -> None:
        """The first divergence is kept; the rest of the scenario runs on
        the engine's own schedule."""
        if self.diverged is None:
            self.diverged = {"step": len(self.steps) - 1, **what}
        self.plan = None

    def _paced(self, want: Step, args: tuple, kwargs: Mapping) -> Any:
        s = self.sched
        self._replay_preemptions(want)
        order = {self.ids.get(k, k): i for i, (k, n, _) in enumerate(want) if n}
        running = list(s.running)
        queues = [q for q in (s.waiting, getattr(s, "skipped_waiting", None)) if q is not None]
        hidden = [[r for r in q if r.request_id not in order] for q in queues]
        budget = s.max_num_scheduled_tokens
        s.running = sorted((r for r in running if r.request_id in order),
                           key=lambda r: order[r.request_id])
        for q, out in zip(queues, hidden):
            q.remove_requests(out)
        self.caps = {self.ids.get(k, k): c for k, _, c in want if c >= 0}
        s.max_num_scheduled_tokens = sum(n for _, n, _ in want)
        try:
            return self._schedule(*args, **kwargs)
        finally:
            s.max_num_scheduled_tokens = budget
            self.caps = {}
            s.running = s.running + [r for r in running if r.request_id not in order]
            for q, back in zip(queues, hidden):
                _merge(q, back)


    def _replay_preemptions(self, want: Step) -> None:
        """Preempt, before this step's schedule, what the recorded engine
        preempted since its previous step (once: a stalled call retries)."""
        for key, _, c in want:
            if c != PREEMPTED:
                continue
            rid = self.ids.get(key, key)
            if rid in self.preempted:
                continue
            request = next((r for r in self.sched.running if r.request_id == rid), None)
            if request is None:
                self._diverge({"wanted": want, "not_running": key})
                return
            self.sched.running.remove(request)
            self.preempt_request(request, time.monotonic())


def _admitted(out: Any) -> dict[str, int]:
    """Request id -> computed tokens of the requests admitted (new) or
    resumed after a preemption in this step."""
    got = {r.req_id: r.num_computed_tokens for r in getattr(out, "scheduled_new_reqs", ())}
    cached = getattr(out, "scheduled_cached_reqs", None)
    for rid in getattr(cached, "resumed_req_ids", ()) or ():
        got[rid] = cached.num_computed_tokens[cached.req_ids.index(rid)]
    return got


def _truncated(blocks: Any, n: int) -> Any:
    """The first ``n`` blocks of every group of a prefix hit."""
    return type(blocks)(tuple(list(group)[:n] for group in blocks.blocks))


def _merge(queue: Any, back: list) -> None:
    """Put hidden requests back into a waiting queue in arrival order."""
    if not back:
        return
    rest = list(queue)
    queue.remove_requests(rest)
    for r in sorted(rest + back, key=lambda r: (r.arrival_time, r.request_id)):
        queue.add_request(r)


__all__ = ["ScheduleTap", "Step", "step_counts"]
