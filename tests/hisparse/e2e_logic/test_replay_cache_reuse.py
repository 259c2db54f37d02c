# SPDX-License-Identifier: Apache-2.0
"""T1 (the gate's replay arm). Run 27's `on_ordered/returning` failure, reproduced on the CPU as a
property of the gate's replay arm, not of HiSparse.

The replay engine (`rep_c2k`) replays several HiSparse engines' scenarios in
ONE vLLM engine and `run_scenario` never resets its prefix cache between
them. In run 27 it replayed `on_nopressure/returning` and then
`on_ordered/returning`: the same prompts under two different schedules. The
second replay caps the first turns' hits at 0, so they are recomputed into
fresh blocks, but those blocks' hashes already exist in the pool, and the
pin's `BlockPool.get_cached_block` returns the FIRST block cached for a hash
("If there are duplicated blocks, we return the first block in the cache").
A follow-up's prefix hit in the second replay therefore reads the KV that
the FIRST replay computed, under another schedule (other batches, other low
bits): exactly 3/r1, whose first turn 0/r1 is the only one whose computation
differs between the two schedules (its first sampled logprob differs between
rep_c2k/on_nopressure/returning and rep_c2k/on_ordered/returning), while the
HiSparse engine's 3/r1 equals run 24's audit engine and run 24's replay
bit for bit (run 24's replay engine ran `returning` only once).
"""

import pytest
import schedule_replay as replay

from tests.hisparse.e2e_logic.test_schedule_replay import run, scenario
from tests.hisparse.scheduler.harness import (
    BaselineAsync,
    baseline_kv_cache_config,
    make_scheduler,
)


def _watch_blocks(b) -> dict[str, set[int]]:
    """Every GPU block id each request held at any step."""
    held: dict[str, set[int]] = {}
    schedule = b.schedule

    def wrapped():
        out = schedule()
        for req in list(b.running):
            ids = b.kv_cache_manager.get_block_ids(req.request_id)[0]
            held.setdefault(req.request_id, set()).update(i for i in ids if i)
        return out

    b.schedule = wrapped
    return held


def _off_engine(tmp_path, name: str, budget: int):
    b = make_scheduler(tmp_path / name, baseline_kv_cache_config(num_gpu_blocks=2000),
                       async_scheduling=True, max_num_batched_tokens=budget)
    return b, BaselineAsync(b)


def _follow_up_source(tmp_path, reset_between: bool):
    """Two recorded schedules of the same scenario (here two natural off
    schedules at different chunk sizes, standing for on_nopressure's and
    on_ordered's), replayed one after the other by ONE off engine, as
    rep_c2k did in run 27. Returns a follow-up's blocks in the second
    replay, its first turn's blocks in the first and in the second replay,
    and its prefix-hit pages."""
    calls = scenario()
    x, xd = _off_engine(tmp_path, "x", 128)
    plan1 = run(x, xd, replay.ScheduleTap(x), calls, "x")
    y, yd = _off_engine(tmp_path, "y", 256)
    plan2 = run(y, yd, replay.ScheduleTap(y), calls, "y")
    assert plan1 != plan2  # two schedules of the same prompts

    b, bd = _off_engine(tmp_path, "rep", 256)
    held = _watch_blocks(b)
    tap = replay.ScheduleTap(b)
    assert run(b, bd, tap, calls, "first", plan=plan1) == plan1
    if reset_between:
        assert b.reset_prefix_cache()
    tap = replay.ScheduleTap(b)
    assert run(b, bd, tap, calls, "second", plan=plan2) == plan2
    assert tap.diverged is None
    hit = {k: c for step in plan2 for k, _, c in step if c >= 0}
    conv = next(k.split("/")[1] for k in hit if k.startswith("1/") and hit[k] > 0)
    assert hit[f"0/{conv}"] == 0  # the first turn is recomputed in each replay
    b1, b2 = held[f"0/{conv}-first"], held[f"0/{conv}-second"]
    assert not b1 & b2  # ... into fresh blocks in the second replay
    return held[f"1/{conv}-second"], b1, b2, hit[f"1/{conv}"] // b.block_size


@pytest.mark.parametrize("reset_between", [False, True], ids=["as_run27", "reset"])
def test_second_replay_reads_the_first_replays_kv(tmp_path, reset_between):
    ids, first_blocks, second_blocks, pages = _follow_up_source(tmp_path, reset_between)
    assert pages > 0
    from_first, from_second = len(ids & first_blocks), len(ids & second_blocks)
    if reset_between:
        # With a reset the follow-up reads its own replay's computation.
        assert from_first == 0 and from_second >= pages
    else:
        # As in run 27: every prefix page comes from the FIRST replay's
        # computation of the same tokens (another schedule), none from the
        # second replay's own first turn.
        assert from_first >= pages and from_second == 0
