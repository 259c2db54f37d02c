# SPDX-License-Identifier: Apache-2.0
"""Small helpers shared by the scheduler-side scenario tests."""

import random

from tests.hisparse.scheduler.harness import abort, make_request, run_step
from tests.hisparse.scheduler.invariants import check_invariants


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` seeded token ids (the same prompt for the same seed)."""
    rng = random.Random(seed)
    return [rng.randint(1, 900) for _ in range(n)]


def add_conversations(s, rng, n: int = 10) -> None:
    """``n`` requests sharing a 200-token prefix (host hits, adoption), of
    random suffix and output lengths."""
    shared = [rng.randint(1, 900) for _ in range(200)]
    for i in range(n):
        s.add_request(make_request(
            f"r{i}", shared + [rng.randint(1, 900) for _ in range(rng.randint(50, 600))],
            rng.randint(5, 80)))


def drive(s, driver, abort_at: int, max_steps: int = 5000) -> int:
    """Step ``driver`` until it is idle, checking every invariant after each
    step; abort request r3 at step ``abort_at``."""
    steps = 0
    while driver.busy():
        driver.step()
        check_invariants(s)
        steps += 1
        if steps == abort_at:
            abort(s, ["r3"])
        assert steps < max_steps
    return steps


def coord(s):
    """The scheduler's HiSparse KV-cache coordinator."""
    return s.kv_cache_manager.coordinator


def hs(s):
    """The residency coordinator (``HiSparseCoordinator``)."""
    return coord(s).hisparse


def step(s, w):
    """One engine step with the simulated worker, then every invariant."""
    so = run_step(s, w)
    check_invariants(s)
    return so


def published_pages(s, request) -> int:
    """Leading pages of ``request`` whose hash is in the host prefix cache."""
    pool = coord(s).host_pool
    n = 0
    for h in request.block_hashes:
        if pool.get_cached_block(h, [coord(s).source_group_id]) is None:
            break
        n += 1
    return n
