# SPDX-License-Identifier: Apache-2.0
"""Record an engine's schedule and make another engine follow it (the e2e
gate's and the soak's replay arm, docs/worker.md K28).

vLLM's kernels are not batch-invariant: a request's logits depend on what
else ran in its steps (GEMM tiles, FlashMLA's split-KV plan, MoE blocks),
and on a context-sensitive model that flips greedy tokens (run 9,
results/e2e/README.md). HiSparse under pressure schedules differently from
HiSparse off by design (it defers an admission, waits a step for an
in-flight copy, hits a shorter host prefix, preempts on host exhaustion),
so a comparison with the off arm's own schedule cannot be bitwise. The
replay arm is a HiSparse-off engine whose scheduler takes, step by step,
exactly the requests and token counts the HiSparse engine's scheduler
took, the prefix-hit length each request had at admission, and the same
preemptions and client aborts: then both arms run the same batches, and
every logprob must be equal bit for bit.

``ScheduleTap`` wraps one scheduler (``EngineCore.scheduler``, in process,
or in a server's engine core through the test plugin
``seeded_weights/hisparse_e2e_weights.py``):

- it records, for every step that scheduled tokens, ``[key, tokens,
  computed]`` per request in the scheduler's order, where ``key`` names the
  request (a scenario's ``"call/conversation"``, or the server's request
  id) and ``computed`` is the number of tokens it already had when admitted
  or resumed in this step (prefix hit plus external tokens), or -1 for a
  request already running; first in the step, ``[key, 0, PREEMPTED]`` or
  ``[key, 0, ABORTED]`` for every request preempted or aborted by its
  client since the previous step (only requests that had run: an abort of
  a request never scheduled changes no batch);
- in replay, before each ``schedule()`` it applies the step's preemptions
  and aborts, hides every running and waiting request the step does not
  name, puts the named running ones in the recorded order, sets the step's
  token budget to the recorded total, and caps each admission's prefix hit
  at the recorded ``computed`` (the local hit, then the external tokens its
  KV connector offers); it restores the queues and the budget afterwards.
  vLLM's scheduler gives a request min(its remaining tokens, the budget
  left), so this reproduces the counts. Replayed steps are
  recorded like any other, so the comparison checks that the replay
  reproduced the schedule; where it could not, ``diverged`` says where.
- P/D imports (docs/pd-imports.md): a HiSparse consumer loads an import
  asynchronously (its admission step schedules no token for the request,
  which waits in WAITING_FOR_REMOTE_KVS until the load is reported), so the
  trace first names the request at its first forward, with ``computed`` =
  its local hit plus the imported tokens. A replay arm whose connector
  loads synchronously (SparseMLAExampleConnector over the same files) is
  admitted at exactly that step with the same hit, and its load runs in
  that step's forward: the keyed steps are the same. Its short-hit wait
  (below) counts the connector's tokens, which an admission gets at once.
- a streaming replay (``start(plan=[], streaming=True)`` then ``extend``)
  follows a schedule that is still being recorded elsewhere: with nothing
  left to follow it schedules nothing, until more arrives.

Test-only: it touches scheduler attributes of the pinned vLLM 0.26.0
(``running``, ``waiting``, ``skipped_waiting``, ``requests``,
``max_num_scheduled_tokens``, ``_preempt_request``, ``finish_requests``,
``kv_cache_manager.get_computed_blocks``,
``connector.get_num_new_matched_tokens``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Step = list[list]
"""One recorded step: [[key, num_scheduled_tokens, computed_at_admission]]."""
PREEMPTED = -2
"""``computed`` of a step entry that records a preemption (0 tokens)."""
ABORTED = -3
"""``computed`` of a step entry that records a client's abort (0 tokens)."""
EVENTS = (PREEMPTED, ABORTED)


def step_counts(step: Sequence[Sequence]) -> list[int]:
    """A keyed step as the natural comparison's trace step: the sorted
    per-request token counts (preemptions and aborts carry none)."""
    return sorted(int(n) for _, n, _ in step if n)


def step_keys(step: Sequence[Sequence]) -> list[str]:
    return [k for k, _, _ in step]


class ScheduleTap:
    STALL_LIMIT = 1000
    SHORT_HIT_WAITS = 2
    """Empty calls a replay spends, before a wanted admission, waiting for
    in-flight outputs while its prefix hit is short of the recorded one.
    The recorded engine admitted a follow-up only after its client got the
    parent's last output, which (async scheduling) cached the parent's last
    page; its trace has no step for that gap (soak run 35's twin)."""
    """Consecutive paced calls that scheduled nothing before a (non-
    streaming) replay gives up: the wanted requests never became
    schedulable."""

    def __init__(self, scheduler: Any, sink: Callable[[Step], None] | None = None) -> None:
        self.sched = scheduler
        self.sink = sink
        """Called with every recorded step (a server's trace file)."""
        self.keys: dict[str, str] = {}
        """Internal request id -> the request's key (default: the id)."""
        self.ids: dict[str, str] = {}
        self.steps: list[Step] = []
        self.plan: deque[Step] | None = None
        self.streaming = False
        self.diverged: dict | None = None
        self.caps: dict[str, int] = {}
        self.stalls = 0
        self.short_waits = 0
        self.waited = 0
        """Empty calls spent on short hits since ``start`` (all admissions)."""
        self.events: list[list] = []
        """Preemptions and aborts since the last recorded step."""
        self.ran: set[str] = set()
        """Requests that were scheduled at least once."""
        self.abort: Callable[[str], None] = self._abort_in_scheduler
        """How a replay aborts a request (internal id); an engine whose
        output processor tracks requests replaces it."""
        self._schedule = scheduler.schedule
        scheduler.schedule = self.schedule
        self._preempt = scheduler._preempt_request
        scheduler._preempt_request = self.preempt_request
        self._finish = scheduler.finish_requests
        scheduler.finish_requests = self.finish_requests
        manager = getattr(scheduler, "kv_cache_manager", None)
        self._computed = getattr(manager, "get_computed_blocks", None)
        if self._computed is not None:
            manager.get_computed_blocks = self.get_computed_blocks
        connector = getattr(scheduler, "connector", None)
        self._external = getattr(connector, "get_num_new_matched_tokens", None)
        if self._external is not None:
            connector.get_num_new_matched_tokens = self.get_num_new_matched_tokens

    # ------------------------------------------------------------ control

    def start(self, plan: Sequence[Step] | None = None, streaming: bool = False) -> None:
        """A new scenario: recording only (``plan`` None) or replaying
        ``plan`` (another engine's recorded steps; with ``streaming``, more
        follow through ``extend``)."""
        self.keys, self.ids, self.steps = {}, {}, []
        self.plan = None if plan is None else deque(plan)
        self.streaming = streaming
        self.diverged, self.stalls, self.events, self.ran = None, 0, [], set()
        self.short_waits = self.waited = 0

    def extend(self, steps: Iterable[Step]) -> None:
        """More recorded steps for a streaming replay."""
        if self.plan is not None:
            self.plan.extend(steps)

    def name(self, request_id: str, key: str) -> None:
        """Give a request (internal id) its key, before it runs."""
        self.keys[request_id] = key
        self.ids[key] = request_id

    def finish(self) -> dict | None:
        """End of a replay: steps left over are a divergence."""
        if self.plan and self.diverged is None:
            self._diverge({"left_over": len(self.plan), "wanted": self.plan[0]})
        return self.diverged

    def detach(self) -> None:
        """Give the scheduler its own methods back: what the engine runs
        after a replay (the soak's controls) is not part of its schedule
        (soak run 36 counted the sensitivity control's 55 steps as
        replayed ones)."""
        s = self.sched
        s.schedule, s._preempt_request, s.finish_requests = (
            self._schedule, self._preempt, self._finish)
        if self._computed is not None:
            s.kv_cache_manager.get_computed_blocks = self._computed
        if self._external is not None:
            s.connector.get_num_new_matched_tokens = self._external

    @property
    def following(self) -> bool:
        return self.plan is not None and (bool(self.plan) or self.streaming)

    # ---------------------------------------------------------- the hooks

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not self.following:
            out = self._schedule(*args, **kwargs)
            self._record(out)
            return out
        want = self.plan[0] if self.plan else []
        if self._short_hit(want) and self.short_waits < self.SHORT_HIT_WAITS:
            # Let the in-flight step's output land first: it may cache the
            # page the recorded admission hit (an idle gap on the server).
            self.short_waits += 1
            self.waited += 1
            out = self._paced([], args, kwargs)
            self._consume(want, self._record(out))
            return out
        self.short_waits = 0
        out = self._paced(want, args, kwargs)
        step = self._record(out)
        if want:
            self._consume(want, step)
        elif step is not None:
            self._diverge({"unwanted": step})
        return out

    def preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.events.append([self._key(request.request_id), 0, PREEMPTED])
        return self._preempt(request, *args, **kwargs)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """An abort from outside the scheduler (a client's, or a replay's):
        recorded for the requests it finished that had run. A server's abort
        can race a request's own finish (the engine finished it, the API
        process had not yet seen the last output): vLLM ignores it, and so
        must the trace, or the replay, whose request finished too, diverges.
        Several at once are recorded in key order (vLLM iterates a set)."""
        aborted = self._finish(request_ids, finished_status)
        if getattr(finished_status, "name", "") == "FINISHED_ABORTED":
            keys = sorted(self._key(r.request_id) for r in aborted or ()
                          if r.request_id in self.ran)
            self.events += [[k, 0, ABORTED] for k in keys]
        return aborted

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

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        """The connector's (external tokens, async), cut so that a replayed
        admission's local hit plus external tokens is the recorded hit: an
        import the recorded engine gave up (it computed the prompt, 4.13
        "recompute") is computed here too, not loaded."""
        ext, load_async = self._external(request, num_computed_tokens)
        cap = self.caps.get(request.request_id)
        if cap is None or not ext or num_computed_tokens + ext <= cap:
            return ext, load_async
        ext = max(cap - num_computed_tokens, 0)
        return ext, load_async and ext > 0

    # ------------------------------------------------------------ details

    def _key(self, request_id: str) -> str:
        return self.keys.get(request_id, request_id)

    def _record(self, out: Any) -> Step | None:
        admitted = _admitted(out)
        step = [[self._key(rid), int(n), int(admitted.get(rid, -1))]
                for rid, n in out.num_scheduled_tokens.items() if n]
        if not step:
            return None
        self.ran.update(out.num_scheduled_tokens)
        step, self.events = self.events + step, []
        self.steps.append(step)
        if self.sink is not None:
            self.sink(step)
        return step

    def _consume(self, want: Step, step: Step | None) -> None:
        """A paced call that scheduled nothing leaves the wanted step for
        the next call (the engine may call between a call's last forward and
        the next call's requests); one that scheduled anything consumes it."""
        if step is None:
            self.stalls += 1
            if self.stalls >= self.STALL_LIMIT and not self.streaming:
                self._diverge({"stalled": self.stalls, "wanted": want})
            return
        self.stalls = 0
        self.plan.popleft()
        if step != want:
            self._diverge({"wanted": want, "got": step})

    def _diverge(self, what: dict) -> None:
        """The first divergence is kept; the rest runs on the engine's own
        schedule."""
        if self.diverged is None:
            self.diverged = {"step": len(self.steps) - 1, **what}
        self.plan, self.streaming = None, False

    def _paced(self, want: Step, args: tuple, kwargs: Mapping) -> Any:
        s = self.sched
        self._apply_events(want)
        order = {self.ids.get(k, k): i for i, (k, n, _) in enumerate(want) if n}
        running = list(s.running)
        queues = [q for q in (s.waiting, getattr(s, "skipped_waiting", None)) if q is not None]
        hidden = [[r for r in q if r.request_id not in order] for q in queues]
        budget = s.max_num_scheduled_tokens
        s.running = sorted((r for r in running if r.request_id in order),
                           key=lambda r: order[r.request_id])
        for q, out in zip(queues, hidden):
            q.remove_requests(out)
            _reorder(q, order)
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

    def _short_hit(self, want: Step) -> bool:
        """Is a waiting request this step admits short of its recorded hit
        (a lookup only: vLLM's prefix-cache stats count it once more)?"""
        if self._computed is None:
            return False
        for key, _, cap in want:
            if cap <= 0:
                continue
            request = self.sched.requests.get(self.ids.get(key, key))
            if request is None or request.num_computed_tokens or request in self.sched.running:
                continue
            if self._hit(request) < cap:
                return True
        return False

    def _hit(self, request: Any) -> int:
        """A waiting request's hit if admitted now: the local prefix hit,
        plus the external tokens the connector would load (a lookup; the
        replay arm's connector, HiSparse off, answers from its files)."""
        local = self._computed(request)[1]
        if self._external is None:
            return local
        ext, _ = self._external(request, local)
        return local + (ext or 0)

    def _apply_events(self, want: Step) -> None:
        """Preempt and abort, before this step's schedule, what the recorded
        engine did since its previous step (once: a stalled call retries)."""
        done = {(k, c) for k, _, c in self.events}
        for key, _, c in want:
            if c not in EVENTS or (key, c) in done:
                continue
            rid = self.ids.get(key, key)
            if c == ABORTED:
                live = self.sched.requests.get(rid)
                if live is None or live.is_finished():
                    # The recorded engine processes client aborts between a
                    # step's forward and its output (EngineCore's
                    # _process_aborts_queue), this replay before the next
                    # schedule: a request at its last token was cut there
                    # and finished here. It ends at this step either way.
                    self.events.append([key, 0, ABORTED])
                else:
                    self.abort(rid)
                continue
            request = next((r for r in self.sched.running if r.request_id == rid), None)
            if request is None:
                self._diverge({"wanted": want, "not_running": key})
                return
            self.sched.running.remove(request)
            self.preempt_request(request, time.monotonic())

    def _abort_in_scheduler(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


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


def _reorder(queue: Any, order: Mapping[str, int]) -> None:
    """The wanted requests of a waiting queue in the recorded order: the
    recorded engine may admit in another order than arrival (a request it
    deferred, or whose offloaded prefix was loading, comes after a younger
    one in the same step), and a step's order is its batch's row order."""
    rest = list(queue)
    if [r.request_id for r in rest] == sorted((r.request_id for r in rest), key=order.get):
        return
    queue.remove_requests(rest)
    for r in sorted(rest, key=lambda r: order[r.request_id]):
        queue.add_request(r)


def _merge(queue: Any, back: list) -> None:
    """Put hidden requests back into a waiting queue in arrival order."""
    if not back:
        return
    rest = list(queue)
    queue.remove_requests(rest)
    for r in sorted(rest + back, key=lambda r: (r.arrival_time, r.request_id)):
        queue.add_request(r)


__all__ = ["ABORTED", "PREEMPTED", "ScheduleTap", "Step", "step_counts", "step_keys"]
