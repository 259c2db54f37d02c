# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the kernel reference (spec 5.6, 8.1 R-1): hand-worked cases
K-1..K-5, K-7, K-9, K-10, properties INV-33..INV-41, and a cross-check of the
vectorised reference against a literal per-entry transcription of spec 5.1.

Every test names the INV-n / K-n / T-n / F-n it checks."""

from __future__ import annotations

import pytest
import torch
from hisparse_kernel_cases import (
    POISON,
    FuzzSpec,
    ResolveCase,
    ResolveFuzzer,
    assert_same_case,
    assert_same_tensor,
    f18_cases,
    random_plan,
    random_rows,
    run_reference,
    small_case,
    warm_state,
)
from vllm.v1.hisparse import reference

I32 = torch.int32


def t32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32)


def fresh_state(states: int, hot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((states, hot), -1, dtype=I32),
            torch.arange(hot, dtype=torch.int16).repeat(states, 1))


# Request 0 in state slot 0, one row per entry of topk_rows, N_gpu = 64.
one_request_case = small_case


def next_step(case: ResolveCase, topk_rows) -> ResolveCase:
    """Same layout, new top-k, state carried over, outputs re-poisoned."""
    return ResolveCase(**{**case.__dict__, "topk": t32(topk_rows),
                          "row_req": t32([0] * len(topk_rows)),
                          "dgi": case.dgi.clone(), "lru": case.lru.clone(),
                          "out_rows": None})


# ---------------------------------------------------------------------------
# Hand-worked cases (B = 4, Sa = 6, H = 8, hot blocks 10 and 11)
# topk [9, 2, 14, 5] -> pages 2,0,3,1 offsets 1,2,2,1 -> host rows
# g = 7*4+1 = 29, 5*4+2 = 22, 8*4+2 = 34, 6*4+1 = 25.
# ---------------------------------------------------------------------------

def test_k1_cold_misses_take_slots_in_order():
    """K-1, INV-36: every entry misses, miss i takes LRU slot i, outputs are
    the hot rows in order, lru becomes [K..H-1, 0..K-1]."""
    c = run_reference(one_request_case([[9, 2, 14, 5]]))
    assert c.out_rows.tolist() == [[60, 61, 62, 63]]  # hma(10*4+s) = 60+s
    assert c.plan_src.tolist() == [[29, 22, 34, 25]]
    assert c.plan_dst.tolist() == [[40, 41, 42, 43]]  # 10*4 + s
    assert c.plan_count.tolist() == [4]
    assert c.valid_counts.tolist() == [4]
    assert c.miss_mask.tolist() == [[1, 1, 1, 1]]
    assert c.resolved_g.tolist() == [[29, 22, 34, 25]]
    assert c.dgi.tolist() == [[29, 22, 34, 25, -1, -1, -1, -1]]
    assert c.lru.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    assert c.stat_values == [0, 4, 0, 0]


def test_k2_warm_replay_is_all_hits():
    """K-2: replaying the same top-k hits every entry: no plan entries (plan
    cells untouched), dgi and lru unchanged, hits counted per distinct row."""
    cold = run_reference(one_request_case([[9, 2, 14, 5]]))
    warm = run_reference(next_step(cold, [[9, 2, 14, 5]]))
    assert warm.out_rows.tolist() == [[60, 61, 62, 63]]
    assert warm.plan_count.tolist() == [0]
    assert warm.plan_src.tolist() == [[POISON] * 4]
    assert warm.miss_mask.tolist() == [[0, 0, 0, 0]]
    assert torch.equal(warm.dgi, cold.dgi) and torch.equal(warm.lru, cold.lru)
    assert warm.stat_values == [4, 0, 0, 0]


def test_partial_hits_keep_exact_lru_order():
    """INV-35/36: hits move to the MRU end in LRU-position order, misses take
    the oldest evictables, untouched evictables keep their order.

    After K-1: lru = [4,5,6,7,0,1,2,3], dgi[0..3] = 29,22,34,25.
    topk [2, 3, 9, 13] -> g 22 (hit, slot 1), 23 (miss), 29 (hit, slot 0),
    33 (miss). Hl = [0, 1] (positions 4, 5); E = [4,5,6,7,2,3]; misses take
    slots 4 and 5; new lru = [6,7,2,3] + [4,5] + [0,1]."""
    cold = run_reference(one_request_case([[9, 2, 14, 5]]))
    c = run_reference(next_step(cold, [[2, 3, 9, 13]]))
    assert c.lru.tolist() == [[6, 7, 2, 3, 4, 5, 0, 1]]
    assert c.dgi.tolist() == [[29, 22, 34, 25, 23, 33, -1, -1]]
    # slot 4 -> hot block 11 row 0: hma = 11*6 + 0 = 66; slot 5 -> 67.
    assert c.out_rows.tolist() == [[61, 66, 60, 67]]
    assert c.plan_src.tolist()[0][:2] == [23, 33]
    assert c.plan_dst.tolist()[0][:2] == [44, 45]
    assert c.plan_src.tolist()[0][2:] == [POISON] * 2
    assert c.miss_mask.tolist() == [[0, 1, 0, 1]]
    assert c.stat_values == [2, 2, 0, 0]


def test_k3_padding_rows_leave_state_alone():
    """K-3, INV-33, F13: rows with row_req -1, an out-of-range request or a
    state slot of -1 produce -1 and zero counts and never touch the state of
    the other request (slot 0) or their own."""
    dgi, lru = fresh_state(2, 8)
    c = ResolveCase(
        topk=t32([[9, 2, 14, 5]] * 4), row_req=t32([-1, 1, 0, 7]),
        seq_lens=t32([16, 16]), req_state=t32([0, -1]),
        src_bt=t32([[5, 6, 7, 8], [1, 2, 3, 4]]), res_bt=t32([[0] * 4] * 2),
        hot_bt=t32([[10, 11], [12, 13]]), dgi=dgi, lru=lru, host_rows=1000,
        block_size=4, attn_block_stride=6, max_query_len=1,
        num_gpu_blocks=64)
    run_reference(c)
    alone = run_reference(one_request_case([[9, 2, 14, 5]]))
    for r in (0, 1, 3):
        assert c.out_rows[r].tolist() == [-1] * 4
        assert c.miss_mask[r].tolist() == [0] * 4
        assert c.resolved_g[r].tolist() == [-1] * 4
        assert c.valid_counts[r] == 0 and c.plan_count[r] == 0
        assert c.plan_src[r].tolist() == [POISON] * 4
    assert c.out_rows[2].tolist() == alone.out_rows[0].tolist()
    assert torch.equal(c.dgi[0], alone.dgi[0])
    assert torch.equal(c.lru[0], alone.lru[0])
    assert c.dgi[1].tolist() == [-1] * 8
    assert c.lru[1].tolist() == list(range(8))


def test_k4_corrupt_lru_slot_trips_and_is_not_written():
    """K-4, INV-37: the first miss takes a victim slot 99 outside [0, H): the
    entry resolves to -1, is not in the miss mask, its plan entry has dst -1,
    no dgi cell is written for it, and the value is written back unchanged.
    A corrupt slot that is not a victim (position 5) is never dereferenced."""
    _, lru = fresh_state(1, 8)
    lru[0, 0] = 99
    lru[0, 5] = -300
    c = run_reference(one_request_case([[9, 2, 14, 5]], lru=lru))
    # E = [99, 1, 2, 3, 4, -300, 6, 7]; misses take 99 (trip), 1, 2, 3.
    assert c.out_rows.tolist() == [[-1, 61, 62, 63]]
    assert c.miss_mask.tolist() == [[0, 1, 1, 1]]
    assert c.resolved_g.tolist() == [[-1, 22, 34, 25]]
    assert c.plan_src.tolist() == [[29, 22, 34, 25]]
    assert c.plan_dst.tolist() == [[-1, 41, 42, 43]]
    assert c.valid_counts.tolist() == [3]
    assert c.dgi.tolist() == [[-1, 22, 34, 25, -1, -1, -1, -1]]
    assert c.lru.tolist() == [[4, -300, 6, 7, 99, 1, 2, 3]]
    assert c.stat_values == [0, 4, 1, 0]


def test_duplicated_key_in_dgi_earliest_position_hits():
    """INV-37/38: corruption puts host row 22 in slots 3 and 6. The earliest
    LRU position (slot 6 at position 2) is the hit; slot 3 is evictable and
    is refilled by the first miss."""
    dgi, lru = fresh_state(1, 8)
    lru[0] = torch.tensor([0, 1, 6, 3, 4, 5, 2, 7], dtype=torch.int16)
    dgi[0, 3] = 22
    dgi[0, 6] = 22
    c = run_reference(one_request_case([[2, 9]], dgi=dgi, lru=lru))
    # U = [22 (hit slot 6), 29 (miss)]; E = [0,1,3,4,5,2,7]; miss -> slot 0.
    assert c.out_rows.tolist() == [[11 * 6 + 2, 60]]
    assert c.lru.tolist() == [[1, 3, 4, 5, 2, 7, 0, 6]]
    assert c.dgi[0].tolist() == [29, -1, -1, 22, -1, -1, 22, -1]
    assert c.stat_values == [1, 1, 0, 0]


def test_k5_mtp_union_loads_each_row_once_and_never_clobbers():
    """K-5, F3, INV-36: four verification rows of one request with
    overlapping top-k are one union group; every distinct host row is loaded
    once, no slot that any row hits is evicted (H = q*K is tight), and the
    plan spills from the first row into the second (row0 + m//K, m%K)."""
    q, K = 4, 3
    H = q * K
    cold = run_reference(one_request_case(
        [[0, 1, 2]], hot=H, q=q, hot_blocks=(10, 11, 12)))
    # cold: keys 20, 21, 22 in slots 0, 1, 2; lru = [3..11, 0, 1, 2].
    rows = [[0, 4, 5], [4, 1, 8], [9, 0, 12], [13, 2, 4]]
    c = run_reference(next_step(cold, rows))
    # keys: 0->20 1->21 2->22 4->24 5->25 8->28 9->29 12->32 13->33
    # U order: 20, 24, 25, 21, 28, 29, 32, 33, 22 -> hits 20, 21, 22.
    # Misses take the oldest evictables, slots 3..8 (hot rows 43..48).
    assert c.plan_count.tolist() == [3, 3, 0, 0]
    assert c.plan_src[:2].tolist() == [[24, 25, 28], [29, 32, 33]]
    assert c.plan_dst[:2].tolist() == [[43, 44, 45], [46, 47, 48]]
    assert c.plan_src[2:].flatten().tolist() == [POISON] * 6
    assert c.dgi[0].tolist() == [20, 21, 22, 24, 25, 28, 29, 32, 33,
                                 -1, -1, -1]  # hit slots 0..2 survive
    assert c.lru[0].tolist() == [9, 10, 11, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert c.miss_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 0, 1],
                                    [1, 0, 0]]  # first references only
    # hma: slot s in hot block 10 + s//4 -> (10 + s//4)*6 + s%4.
    assert c.out_rows.tolist() == [[60, 63, 66], [63, 61, 67],
                                   [68, 60, 69], [72, 62, 63]]
    assert c.valid_counts.tolist() == [3, 3, 3, 3]
    assert c.stat_values == [3, 6, 0, 0]


def test_k9_stale_positions_and_null_pages_never_load():
    """K-9, F5, INV-34: positions >= seq_len, -1, pages past the tables,
    null host pages and host rows >= host_rows resolve to -1, are never
    planned, and a group with nothing pending leaves dgi/lru bit-identical
    and writes no plan cell."""
    dgi, lru = fresh_state(1, 8)
    lru[0] = torch.tensor([3, 1, 2, 0, 7, 5, 6, 4], dtype=torch.int16)
    dgi[0, 2] = 123
    c = one_request_case(
        [[-1, 17, 40, 4, 13]], src=(5, 0, 7, 300), seq_len=18,
        host_rows=1000, dgi=dgi.clone(), lru=lru.clone())
    # -1; 17 >= seq_len 18? no: page 4 >= Mh (width 4) -> invalid;
    # 40 >= seq_len; 4 -> page 1 is a null host page; 13 -> page 3, host
    # block 300 -> g = 1201 >= host_rows.
    run_reference(c)
    assert c.out_rows.tolist() == [[-1] * 5]
    assert c.valid_counts.tolist() == [0] and c.plan_count.tolist() == [0]
    assert c.plan_src.tolist() == [[POISON] * 5]
    assert torch.equal(c.dgi, dgi) and torch.equal(c.lru, lru)
    assert c.stat_values == [0, 0, 0, 0]


def test_resident_pages_short_circuit():
    """INV-34, 5.1 step 1: resident pages translate through the resident
    table with Sa (hma = block*Sa + offset) and, with nothing pending, state
    and plan cells stay untouched."""
    dgi, lru = fresh_state(1, 8)
    c = one_request_case([[9, 2, 14, 5]], res=(3, 0, 9, 4), src=(5, 6, 7, 8),
                         dgi=dgi.clone(), lru=lru.clone())
    run_reference(c)
    # page 2 -> block 9: 9*6+1; page 0 -> block 3: 3*6+2; page 3 -> 4*6+2;
    # page 1 is not resident -> host row 25 misses into slot 0 (hma 60).
    assert c.out_rows.tolist() == [[55, 20, 26, 60]]
    assert c.plan_count.tolist() == [1]
    all_res = one_request_case([[9, 2, 14]], res=(3, 0, 9, 4),
                               dgi=dgi.clone(), lru=lru.clone())
    run_reference(all_res)
    assert all_res.out_rows.tolist() == [[55, 20, 26]]
    assert all_res.plan_count.tolist() == [0]
    assert torch.equal(all_res.dgi, dgi) and torch.equal(all_res.lru, lru)


def test_overlong_union_group_is_rejected_as_padding():
    """INV-36 contract guard: more consecutive rows of one request than
    max_query_len cannot be resolved without clobbering; the rows become
    padding, state is untouched and stats[3] counts them."""
    c = one_request_case([[1], [2], [3]], q=2, hot=8)
    run_reference(c)
    assert c.out_rows.tolist() == [[-1]] * 3
    assert c.dgi.tolist() == [[-1] * 8]
    assert c.stat_values == [0, 0, 0, 3]


# N_gpu past the launcher's INV-14 bound (N_gpu * max(Sa, B) < 2^31): only
# the reference can be called like this; it shows the defensive int64 paths.
HUGE_GPU_BLOCKS = 2**40


def test_attention_ids_are_64_bit_then_int32():
    """INV-14, F18: hma is computed in 64 bit; an id that does not fit a
    non-negative int32 resolves to -1 instead of wrapping into a bogus row."""
    big = 2**31 // 6  # block*6 just below 2^31
    c = one_request_case([[9, 2]], res=(0, 0, big + 1, 0), src=(5, 6, 7, 8),
                         num_gpu_blocks=HUGE_GPU_BLOCKS)
    run_reference(c)
    assert c.out_rows.tolist()[0][0] == -1  # (big+1)*6 + 1 > 2^31 - 1
    c = one_request_case([[9]], res=(0, 0, big, 0),
                         num_gpu_blocks=HUGE_GPU_BLOCKS)
    run_reference(c)
    assert c.out_rows.tolist() == [[big * 6 + 1]]


def test_f18_row_ids_compared_in_int64_before_the_cast():
    """F18: an id whose int64 value wraps to a small positive int32 (the
    old cast-then-check bug) resolves to -1 / trips; checked for the
    resident id, the hot row of a miss (plan row and attention id) and an
    attention id that overflows while the plan row (x B) still fits."""
    wrap = 2**32 // 6 + 1  # wrap*6 + 1 = 2^32 + 3 -> int32 3 if truncated
    c = run_reference(one_request_case([[9]], res=(0, 0, wrap, 0),
                                       num_gpu_blocks=HUGE_GPU_BLOCKS))
    assert c.out_rows.tolist() == [[-1]]
    assert c.stat_values == [0, 0, 1, 0]
    assert c.dgi.tolist() == [[-1] * 8]
    for hot_block in (wrap, 400_000_000):  # x4 overflows / only x6 does
        c = run_reference(one_request_case([[9]], hot_blocks=(hot_block, 11),
                                           num_gpu_blocks=HUGE_GPU_BLOCKS))
        assert c.out_rows.tolist() == [[-1]]
        assert c.plan_src.tolist()[0][0] == 29
        assert c.plan_dst.tolist()[0][0] == -1
        assert c.plan_count.tolist() == [1]
        assert c.miss_mask.tolist() == [[0]]
        assert c.resolved_g.tolist() == [[-1]]
        assert c.dgi.tolist() == [[-1] * 8]  # nothing written
        assert c.lru.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
        assert c.stat_values == [0, 1, 1, 0]


# ---------------------------------------------------------------------------
# F18: block ids outside [1, N_gpu) (hand-computed; the GPU test runs the
# same cases against the kernel). Warm state: dgi [29, 22, 34, 25, -1 x4],
# lru [4, 5, 6, 7, 0, 1, 2, 3]; keys 2->22 3->23 9->29 13->33 0->20 1->21.
# ---------------------------------------------------------------------------

def _f18(name: str) -> ResolveCase:
    return run_reference(f18_cases()[name])


def test_f18_null_hot_table_cold_trips_every_miss():
    """F18: a null (all-zero) hot table with host-backed entries: every
    miss's victim has hot block 0, so every entry is -1, nothing is in the
    miss mask, the plan cells keep src and dst = -1 (K2 writes nothing), no
    dgi cell is written; the victims still rotate to the filled end of the
    LRU (INV-35), and every trip is counted."""
    c = _f18("null_hot_cold")
    assert c.out_rows.tolist() == [[-1] * 4]
    assert c.miss_mask.tolist() == [[0] * 4]
    assert c.resolved_g.tolist() == [[-1] * 4]
    assert c.valid_counts.tolist() == [0]
    assert c.plan_src.tolist() == [[29, 22, 34, 25]]
    assert c.plan_dst.tolist() == [[-1] * 4]
    assert c.plan_count.tolist() == [4]
    assert c.dgi.tolist() == [[-1] * 8]
    assert c.lru.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    assert c.stat_values == [0, 4, 4, 0]


def test_f18_null_hot_table_warm_hits_are_unreadable():
    """F18: with the hot table nulled under warm state, hits (22 in slot 1,
    29 in slot 0) cannot be read: -1, yet they stay hits (MRU end, dgi
    kept: the LRU stays a permutation); misses 23, 33 trip on slots 4, 5."""
    c = _f18("null_hot_warm")
    dgi, _ = warm_state()
    assert c.out_rows.tolist() == [[-1] * 4]
    assert c.resolved_g.tolist() == [[-1] * 4]
    assert c.miss_mask.tolist() == [[0] * 4]
    assert c.plan_src.tolist()[0][:2] == [23, 33]
    assert c.plan_dst.tolist()[0] == [-1, -1, POISON, POISON]
    assert c.plan_count.tolist() == [2]
    assert torch.equal(c.dgi, dgi)
    assert c.lru.tolist() == [[6, 7, 2, 3, 4, 5, 0, 1]]
    assert c.stat_values == [2, 2, 4, 0]


def test_f18_hot_block_n_gpu_trips_and_n_gpu_minus_1_is_valid():
    """F18: hot blocks (63, 64) with N_gpu = 64: slots 0..3 (block 63) load
    and resolve to 63*6 + s, plan rows 63*4 + s; slots 4, 5 (block 64 =
    N_gpu) trip."""
    c = _f18("hot_id_n_gpu")
    assert c.out_rows.tolist() == [[378, 379, 380, 381, -1, -1]]
    assert c.plan_src.tolist() == [[29, 22, 34, 25, 20, 21]]
    assert c.plan_dst.tolist() == [[252, 253, 254, 255, -1, -1]]
    assert c.plan_count.tolist() == [6]
    assert c.miss_mask.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert c.resolved_g.tolist() == [[29, 22, 34, 25, -1, -1]]
    assert c.valid_counts.tolist() == [4]
    assert c.dgi.tolist() == [[29, 22, 34, 25, -1, -1, -1, -1]]
    assert c.lru.tolist() == [[6, 7, 0, 1, 2, 3, 4, 5]]
    assert c.stat_values == [0, 6, 2, 0]


def test_f18_negative_hot_block_trips_misses_hits_served():
    """F18: hot blocks (10, -3) under warm state: hits in block 10 resolve,
    misses taking slots 4, 5 (block -3) trip; dgi is not written."""
    c = _f18("hot_id_negative")
    dgi, _ = warm_state()
    assert c.out_rows.tolist() == [[61, -1, 60, -1]]
    assert c.resolved_g.tolist() == [[22, -1, 29, -1]]
    assert c.miss_mask.tolist() == [[0, 0, 0, 0]]
    assert c.plan_dst.tolist()[0][:2] == [-1, -1]
    assert c.plan_count.tolist() == [2]
    assert c.valid_counts.tolist() == [2]
    assert torch.equal(c.dgi, dgi)
    assert c.lru.tolist() == [[6, 7, 2, 3, 4, 5, 0, 1]]
    assert c.stat_values == [2, 2, 2, 0]


def test_f18_hit_on_invalid_hot_block_keeps_its_lru_place():
    """F18, INV-35: all-hit step whose hits sit in a hot block >= N_gpu:
    -1, no plan, dgi unchanged, the hits still move to the MRU end (the
    same permutation a valid table gives); two distinct hits, three
    references, so three trips (a trip per unreadable reference)."""
    c = _f18("hot_hit_invalid")
    dgi, _ = warm_state()
    assert c.out_rows.tolist() == [[-1, -1, -1]]
    assert c.resolved_g.tolist() == [[-1, -1, -1]]
    assert c.miss_mask.tolist() == [[0, 0, 0]]
    assert c.valid_counts.tolist() == [0]
    assert c.plan_count.tolist() == [0]
    assert c.plan_src.tolist() == [[POISON] * 3]
    assert torch.equal(c.dgi, dgi)
    assert c.lru.tolist() == [[4, 5, 6, 7, 2, 3, 0, 1]]
    assert c.stat_values == [2, 0, 3, 0]
    valid = run_reference(small_case([[2, 9, 2]], dgi=warm_state()[0],
                                     lru=warm_state()[1]))
    assert valid.out_rows.tolist() == [[61, 60, 61]]
    assert torch.equal(valid.lru, c.lru)


def test_f18_resident_id_n_gpu_is_not_a_host_read():
    """F18: resident id N_gpu on page 2 resolves to -1 although the page
    has a host block (never pending); page 0 (resident 0) misses as usual."""
    c = _f18("res_id_n_gpu")
    assert c.out_rows.tolist() == [[-1, 60]]
    assert c.plan_src.tolist() == [[22, POISON]]
    assert c.plan_dst.tolist() == [[40, POISON]]
    assert c.plan_count.tolist() == [1]
    assert c.miss_mask.tolist() == [[0, 1]]
    assert c.resolved_g.tolist() == [[-1, 22]]
    assert c.dgi.tolist() == [[22, -1, -1, -1, -1, -1, -1, -1]]
    assert c.lru.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert c.stat_values == [0, 1, 1, 0]


@pytest.mark.parametrize("name, out, trips", [
    ("res_ids_huge", [-1] * 5, 5),
    ("res_ids_mixed", [-1, -1, -1, 3 * 6 + 2], 3),
])
def test_f18_huge_resident_ids_change_nothing(name, out, trips):
    """F18, INV-34: resident ids 2^31 - 1, -1, one whose id*Sa overflows
    int32 and N_gpu resolve to -1 and are not pending: the group takes the
    resident short-circuit, dgi/lru stay bit-identical, no plan cell is
    written; the trips still reach stats[2]."""
    c = _f18(name)
    dgi, lru = warm_state()
    assert c.out_rows.tolist() == [out]
    assert c.valid_counts.tolist() == [sum(x >= 0 for x in out)]
    assert c.plan_count.tolist() == [0]
    assert c.plan_src.tolist() == [[POISON] * len(out)]
    assert c.plan_dst.tolist() == [[POISON] * len(out)]
    assert c.miss_mask.tolist() == [[0] * len(out)]
    assert c.resolved_g.tolist() == [[-1] * len(out)]
    assert torch.equal(c.dgi, dgi) and torch.equal(c.lru, lru)
    assert c.stat_values == [0, 0, trips, 0]


def test_f18_valid_tables_unchanged():
    """F18 changes nothing for valid ids: K-1 and the partial-hit step with
    N_gpu = 12 (hot blocks 10, 11 the largest ids) give the same results as
    with N_gpu = 64."""
    for n in (12, 64):
        cold = run_reference(one_request_case([[9, 2, 14, 5]],
                                              num_gpu_blocks=n))
        assert cold.out_rows.tolist() == [[60, 61, 62, 63]]
        warm = run_reference(next_step(cold, [[2, 3, 9, 13]]))
        assert warm.out_rows.tolist() == [[61, 66, 60, 67]]
        assert warm.stat_values == [2, 2, 0, 0]


# ---------------------------------------------------------------------------
# Literal transcription of spec 5.1/5.6 (per-entry loops, dicts, lists)
# ---------------------------------------------------------------------------

def loop_resolve(c: ResolveCase) -> ResolveCase:
    topk, row_req = c.topk.tolist(), c.row_req.tolist()
    seq, state_of = c.seq_lens.tolist(), c.req_state.tolist()
    src, res, hot = c.src_bt.tolist(), c.res_bt.tolist(), c.hot_bt.tolist()
    dgi, lru = c.dgi.tolist(), c.lru.tolist()
    R, K = c.topk.shape
    S, H = c.dgi.shape
    B, Sa, q = c.block_size, c.attn_block_stride, c.max_query_len
    N = c.num_gpu_blocks
    out = [[-1] * K for _ in range(R)]
    miss = [[0] * K for _ in range(R)]
    resolved = [[-1] * K for _ in range(R)]
    plan_src, plan_dst = c.plan_src.tolist(), c.plan_dst.tolist()
    count = [0] * R
    stats = c.stats.view(torch.int64).tolist()

    def row_id(block: int, off: int, stride: int) -> int:
        """F18: block in [1, N), id in int32, else -1 (no wrapping)."""
        v = block * stride + off
        return v if 1 <= block < N and 0 <= v < 2**31 else -1

    row = 0
    while row < R:
        req = row_req[row]
        if not 0 <= req < len(seq):
            row += 1
            continue
        n = 1
        while row + n < R and row_req[row + n] == req:
            n += 1
        st = state_of[req]
        if not 0 <= st < S or n > q:
            if 0 <= st < S:
                stats[3] += n
            row += n
            continue
        U, index, entries = [], {}, {}
        for i in range(n):
            for k in range(K):
                p = topk[row + i][k]
                if p < 0 or p >= seq[req]:
                    continue
                page, off = divmod(p, B)
                rb = res[req][page] if page < len(res[req]) else 0
                if rb != 0:
                    out[row + i][k] = row_id(rb, off, Sa)
                    stats[2] += out[row + i][k] < 0
                    continue
                sb = src[req][page] if page < len(src[req]) else 0
                g = sb * B + off
                if sb > 0 and g < c.host_rows:
                    first = g not in index
                    if first:
                        index[g] = len(U)
                        U.append(g)
                    entries[(i, k)] = (index[g], first)
        if U:
            hits, evict, slot_of = [], [], {}
            for pos in range(H):
                s = lru[st][pos]
                if not 0 <= s < H:
                    evict.append(s)
                    continue
                u = index.get(dgi[st][s]) if dgi[st][s] >= 0 else None
                if u is not None and u not in slot_of:
                    slot_of[u] = s
                    hits.append(s)
                else:
                    evict.append(s)
            M = [u for u in range(len(U)) if u not in slot_of]
            for m, u in enumerate(M):
                v = evict[m]
                plan_src[row + m // K][m % K] = U[u]
                d = a = -1
                if 0 <= v < H:
                    d = row_id(hot[req][v // B], v % B, B)
                    a = row_id(hot[req][v // B], v % B, Sa)
                if d >= 0 and a >= 0:
                    dgi[st][v] = U[u]
                    slot_of[u] = v
                    plan_dst[row + m // K][m % K] = d
                else:  # tripwire 2 or an invalid hot block (F18)
                    plan_dst[row + m // K][m % K] = -1
                    stats[2] += 1
            lru[st] = evict[len(M):] + evict[:len(M)] + hits
            missed = set(M)
            for (i, k), (u, first) in entries.items():
                if u in slot_of:
                    v = slot_of[u]
                    x = row_id(hot[req][v // B], v % B, Sa)
                    if x < 0:  # a hit on an invalid hot block (F18)
                        stats[2] += 1
                        continue
                    out[row + i][k] = x
                    resolved[row + i][k] = U[u]
                    miss[row + i][k] = int(first and u in missed)
            stats[0] += len(hits)
            stats[1] += len(M)
            for i in range(n):
                count[row + i] = max(0, min(K, len(M) - i * K))
        row += n
    c.out_rows.copy_(t32(out))
    c.miss_mask.copy_(t32(miss))
    c.resolved_g.copy_(t32(resolved))
    c.plan_src.copy_(t32(plan_src))
    c.plan_dst.copy_(t32(plan_dst))
    c.plan_count.copy_(t32(count))
    c.valid_counts.copy_((c.out_rows >= 0).sum(1).to(I32))
    c.dgi.copy_(t32(dgi))
    c.lru.copy_(torch.tensor(lru, dtype=torch.int16))
    c.stats.view(torch.int64).copy_(torch.tensor(stats))
    return c


LOOP_SPECS = [
    FuzzSpec(top_k=1, hot_size=1, block_size=4),
    FuzzSpec(top_k=3, hot_size=3, block_size=2, max_query_len=1),
    FuzzSpec(top_k=5, hot_size=20, block_size=4, max_query_len=4),
    FuzzSpec(top_k=8, hot_size=33, block_size=8, max_query_len=3,
             corrupt=True),
    FuzzSpec(top_k=33, hot_size=66, block_size=16, max_query_len=2,
             num_reqs=5),
    FuzzSpec(top_k=16, hot_size=64, block_size=4, max_query_len=4,
             groups_full=True, corrupt=True, attn_block_stride=4),
    FuzzSpec(top_k=8, hot_size=24, block_size=4, max_query_len=2,
             corrupt=True, corrupt_tables=True),
    FuzzSpec(top_k=33, hot_size=99, block_size=16, max_query_len=3,
             corrupt_tables=True, resident_frac=0.4),
]


@pytest.mark.parametrize("spec", LOOP_SPECS,
                         ids=lambda s: f"K{s.top_k}-H{s.hot_size}-q"
                         f"{s.max_query_len}{'-corrupt' if s.corrupt else ''}"
                         f"{'-tables' if s.corrupt_tables else ''}")
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_equals_literal_spec_loop(spec, seed):
    """T2 oracle check, INV-35..38: the vectorised reference equals a literal
    per-entry transcription of spec 5.1 over several warm steps with
    padding, -1/stale positions, null pages, MTP unions and corruption."""
    fuzz = ResolveFuzzer(FuzzSpec(**{**spec.__dict__, "seed": seed}))
    for step in range(4):
        case = fuzz.step(overlap=0.6)
        want = loop_resolve(case.to("cpu"))
        got = run_reference(case.to("cpu"))
        assert_same_case(got, want, label=f"step {step}: ")
        fuzz.adopt_state(got)


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

def _group_rows(row_req: list[int], q: int):
    row = 0
    while row < len(row_req):
        n = 1
        while row + n < len(row_req) and row_req[row + n] == row_req[row]:
            n += 1
        yield row, n
        row += n


@pytest.mark.parametrize("q", [1, 3])
def test_lru_permutation_and_victim_rules(q):
    """INV-35: every lru row stays a permutation. INV-36: miss m of a group
    takes the m-th oldest slot that is not a hit, each distinct host row is
    loaded once, and no other slot (in particular no hit slot) changes."""
    H = 12 * (q + 1)
    fuzz = ResolveFuzzer(FuzzSpec(top_k=12, hot_size=H, block_size=4,
                                  max_query_len=q, num_reqs=6, num_states=8,
                                  seed=7))
    for _ in range(8):
        case = fuzz.step(overlap=0.5)
        pre_dgi, pre_lru = case.dgi.clone(), case.lru.clone()
        run_reference(case)
        for s in range(case.lru.shape[0]):
            assert sorted(case.lru[s].tolist()) == list(range(H))
        for row0, n in _group_rows(case.row_req.tolist(), q):
            req = int(case.row_req[row0])
            if not 0 <= req < case.seq_lens.numel():
                continue
            st = int(case.req_state[req])
            if st < 0:
                continue
            planned = int(case.plan_count[row0:row0 + n].sum())
            keys = case.plan_src[row0:row0 + n].flatten()[:planned].tolist()
            assert len(set(keys)) == len(keys)
            served = set(case.resolved_g[row0:row0 + n].flatten().tolist())
            served.discard(-1)
            hit_slots = {s for s in range(H) if int(pre_dgi[st, s]) in served}
            oldest = [s for s in pre_lru[st].tolist() if s not in hit_slots]
            victims = oldest[:planned]
            assert case.dgi[st, victims].tolist() == keys
            others = [s for s in range(H) if s not in victims]
            assert torch.equal(case.dgi[st, others], pre_dgi[st, others])
        fuzz.adopt_state(case)


# ---------------------------------------------------------------------------
# K4 invalidate_written_slots
# ---------------------------------------------------------------------------

def test_k10_invalidate_written_slots():
    """K-10, INV-41: after the call no dgi entry of a written request's slot
    equals a host row written in the forward; other slots, other rows and
    tokens with no request, no state or no host row change nothing."""
    dgi = t32([[5, 6, 7, 5], [5, 6, 8, 9], [1, 2, 3, 4]])
    req_state = t32([1, -1, 0])
    token_req = t32([2, 2, 1, 0, -1, 9, 0])
    written = torch.tensor([5, 9, 1, 8, 2, 3, -1], dtype=torch.int64)
    reference.ref_invalidate(dgi, req_state, token_req, written)
    assert dgi.tolist() == [[-1, 6, 7, -1], [5, 6, -1, 9], [1, 2, 3, 4]]
    reference.ref_invalidate(dgi, req_state, token_req[:0], written[:0])
    assert dgi.tolist() == [[-1, 6, 7, -1], [5, 6, -1, 9], [1, 2, 3, 4]]


def test_k10_invalidate_takes_every_index_group_at_once():
    """K-10, INV-41, P2: K4 over the runtime's stacked hot state [G, S, H]
    clears in every group exactly what a launch per group clears."""
    gen = torch.Generator().manual_seed(7)
    stacked = torch.randint(-1, 40, (3, 5, 16), dtype=torch.int32, generator=gen)
    req_state = t32([4, 0, -1, 2])
    token_req = torch.randint(-1, 5, (30,), dtype=torch.int32, generator=gen)
    written = torch.randint(-2, 40, (30,), dtype=torch.int64, generator=gen)
    alone = stacked.clone()
    for group in alone:
        reference.ref_invalidate(group, req_state, token_req, written)
    before = stacked.clone()
    reference.ref_invalidate(stacked, req_state, token_req, written)
    assert torch.equal(stacked, alone) and not torch.equal(stacked, before)


# ---------------------------------------------------------------------------
# K2/K3 gathers
# ---------------------------------------------------------------------------

def _strided_dst(blocks: int, block: int, width: int, pad: int = 3):
    """[blocks, block, W] view with a block stride larger than block*W."""
    base = torch.full((blocks, block * width + pad * 16), 0xAB,
                      dtype=torch.uint8)
    return base, base[:, :block * width].view(blocks, block, width)


def test_k7_gather_compact_copies_zero_fills_and_skips():
    """K-7, INV-39: exactly clamp(count, 0, K) entries per row are copied;
    g >= source rows zero-fills, negative ids and destinations past N*B are
    skipped; nothing else in the slab changes (strided view)."""
    src = random_rows(10, 32, torch.Generator().manual_seed(0))
    base, dst = _strided_dst(3, 4, 32)
    before = base.clone()
    plan_src = t32([[1, 12, -1, 4], [7, 2, 3, 0]])
    plan_dst = t32([[0, 5, 6, 11], [3, 12, -2, 9]])
    plan_count = t32([9, 2])
    reference.ref_gather_compact(src, dst, plan_src, plan_dst, plan_count)
    rows = dst.reshape(12, 32)
    assert torch.equal(rows[0], src[1])
    assert torch.equal(rows[5], torch.zeros(32, dtype=torch.uint8))
    assert torch.equal(rows[11], src[4])
    assert torch.equal(rows[3], src[7])
    changed = (base != before).any(1)
    touched = {0, 5, 11, 3}
    for r in range(12):
        if r not in touched:
            assert torch.equal(rows[r], before[:, :128].reshape(12, 32)[r])
    assert changed.tolist() == [True, True, True]
    assert torch.equal(base[:, 128:], before[:, 128:])  # padding untouched


def test_gather_plan_out_rows_padding_and_mask():
    """K-7, spec 5.3: padding rows write -1 and copy nothing; out_rows is
    hma(d) for d >= 0 whatever the mask; only masked entries copy."""
    src = random_rows(6, 16, torch.Generator().manual_seed(1))
    base, dst = _strided_dst(2, 4, 16, pad=0)
    before = base.clone()
    src_rows = t32([[0, 1, 2], [3, 4, 9]])
    dst_rows = t32([[0, 5, -1], [6, 7, 2]])
    mask = t32([[1, 0, 1], [1, 1, 1]])
    out = torch.full((2, 3), POISON, dtype=I32)
    reference.ref_gather_plan(src, dst, src_rows, dst_rows, mask,
                              t32([0, -1]), out, 10)
    assert out.tolist() == [[0, 11, -1], [-1, -1, -1]]
    assert torch.equal(dst.reshape(8, 16)[0], src[0])
    assert torch.equal(base.reshape(8, 16)[1:], before.reshape(8, 16)[1:])
    reference.ref_gather_plan(src, dst, src_rows, dst_rows, mask, None, out,
                              10)
    assert out.tolist() == [[0, 11, -1], [12, 13, 2]]
    assert torch.equal(dst.reshape(8, 16)[6], src[3])
    assert torch.equal(dst.reshape(8, 16)[2], torch.zeros(16,
                                                          dtype=torch.uint8))


def test_count_clamp_and_random_plans_match_rowwise_copy():
    """INV-39: over random plans (negative, 0, mid, K and > K counts,
    negative and overflowing ids) the reference equals a row-by-row copy."""
    gen = torch.Generator().manual_seed(3)
    src = random_rows(50, 48, gen)
    for _ in range(5):
        ps, pd, pc = random_plan(6, 7, 50, 60, gen)
        _, dst = _strided_dst(15, 4, 48)
        want = dst.clone()
        for i in range(6):
            for j in range(max(0, min(int(pc[i]), 7))):
                g, d = int(ps[i, j]), int(pd[i, j])
                if g < 0 or d < 0 or d >= 60:
                    continue
                want[d // 4, d % 4] = src[g] if g < 50 else 0
        reference.ref_gather_compact(src, dst, ps, pd, pc)
        assert_same_tensor("dst", dst, want)


@pytest.mark.parametrize("q", [1, 2])
def test_inv40_gather_plan_equals_gather_compact(q):
    """INV-40: gather_plan over K1's per-entry outputs (src = resolved_g,
    dst = physical row from out_rows, mask = miss_mask) writes the same bytes
    as gather_compact over K1's plan."""
    fuzz = ResolveFuzzer(FuzzSpec(top_k=24, hot_size=24 * (q + 1),
                                  block_size=8, max_query_len=q, seed=11,
                                  corrupt=True))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        case = run_reference(fuzz.step(overlap=0.5))
        fuzz.adopt_state(case)
        blocks = int(case.hot_bt.max()) + int(case.res_bt.max()) + 2
        src = random_rows(case.host_rows + 3, 32, gen)
        _, a = _strided_dst(blocks, case.block_size, 32)
        b = a.clone()
        reference.ref_gather_compact(src, a, case.plan_src, case.plan_dst,
                                     case.plan_count)
        x = case.out_rows.to(torch.int64)
        sa, bs = case.attn_block_stride, case.block_size
        phys = torch.where(x >= 0, x // sa * bs + x % sa, -1).to(I32)
        reference.ref_gather_plan(src, b, case.resolved_g, phys,
                                  case.miss_mask, None, None, sa)
        assert_same_tensor("hot view", b, a)


# ---------------------------------------------------------------------------
# K5 copy_descriptors
# ---------------------------------------------------------------------------

def test_copy_descriptors_reference_moves_bytes():
    """INV-42 (reference side): each descriptor moves exactly nbytes from
    src to dst; non-positive sizes and null pointers are skipped."""
    src = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    s0, d0 = src.data_ptr(), dst.data_ptr()
    reference.ref_copy_descriptors(
        torch.tensor([s0 + 3, s0 + 100, s0, 0], dtype=torch.int64),
        torch.tensor([d0 + 10, d0 + 200, d0 + 50, d0], dtype=torch.int64),
        torch.tensor([7, 40, 0, 5], dtype=torch.int64))
    want = torch.zeros(256, dtype=torch.uint8)
    want[10:17] = src[3:10]
    want[200:240] = src[100:140]
    assert torch.equal(dst, want)


def test_union_groups_split_runs_and_padding():
    """Spec 5.1 union groups: maximal runs of one request; -1, out-of-range
    requests and -1 state slots are padding; runs longer than q rejected."""
    groups = list(reference.union_groups(t32([-1, 0, 0, 1, 1, 1, 0, 5, 2]),
                                         t32([3, 4, -1]), 8, 2))
    assert [(g.row0, g.rows, g.req, g.state, g.rejected) for g in groups] == [
        (0, 1, -1, -1, False), (1, 2, 0, 3, False), (3, 3, 1, 4, True),
        (6, 1, 0, 3, False), (7, 1, -1, -1, False), (8, 1, -1, -1, False)]


def test_fuzzer_is_seeded():
    """The GPU fuzz relies on identical inputs for identical seeds."""
    a = ResolveFuzzer(FuzzSpec(top_k=9, hot_size=18, seed=4)).step()
    b = ResolveFuzzer(FuzzSpec(top_k=9, hot_size=18, seed=4)).step()
    assert torch.equal(a.topk, b.topk) and torch.equal(a.src_bt, b.src_bt)
    c = ResolveFuzzer(FuzzSpec(top_k=9, hot_size=18, seed=5)).step()
    assert not torch.equal(a.topk, c.topk)


@pytest.mark.parametrize("first, n", [(0, 96), (5, 40), (90, 6), (17, 0)])
def test_k5b_mirror_descriptors_equal_the_literal_rule(first, n):
    """K5b (docs/kernels.md): descriptor l * n + t copies token first + t's
    row of layer l's resident group to its host row, 0 bytes where either
    slot is padding; entries past L * n are untouched."""
    from hisparse_kernel_cases import mirror_case

    c = mirror_case(seed=first + n)
    reference.ref_mirror_descriptors(**c, first=first, n=n)
    L = c["pair_of_layer"].shape[0]
    B, bpb, W = c["block_size"], c["bytes_per_block"], c["row_bytes"]
    for l in range(L):
        slots = c["resident_slots"][int(c["pair_of_layer"][l])]
        for t in range(n):
            r, h = int(slots[first + t]), int(c["source_slots"][first + t])
            i = l * n + t
            rr, hh = max(r, 0), max(h, 0)
            assert int(c["src"][i]) == int(c["src_base"][l]) + rr // B * bpb + rr % B * W
            assert int(c["dst"][i]) == int(c["dst_base"][l]) + hh * W
            assert int(c["nbytes"][i]) == (W if r >= 0 and h >= 0 else 0)
    assert (c["nbytes"][L * n:] == -7).all()


def test_k6_order_plan_sorts_each_row_by_source_and_keeps_the_pairs():
    """P9 / INV-36: K6 sorts each row's first clamp(count, 0, K) cells by
    source row (the host address K2 reads), carrying each destination with
    its source; cells past the count are untouched; K2 then writes exactly
    what it wrote from K1's order."""
    g = torch.Generator().manual_seed(3)
    rows, K = 5, 16
    plan_src = torch.stack([torch.randperm(1000, generator=g)[:K] for _ in range(rows)]).to(
        torch.int32)
    plan_dst = torch.stack([torch.randperm(40, generator=g)[:K] for _ in range(rows)]).to(
        torch.int32)
    plan_dst[1, 2] = -1  # a tripped miss keeps its cell
    plan_count = t32([K, 0, 1, 7, K + 5])
    plan_count[1] = 9
    ps, pd = plan_src.clone(), plan_dst.clone()
    reference.ref_order_plan(ps, pd, plan_count)
    for r, n in enumerate(plan_count.clamp(0, K).tolist()):
        assert ps[r, :n].tolist() == sorted(plan_src[r, :n].tolist())
        assert sorted(zip(ps[r, :n].tolist(), pd[r, :n].tolist())) == sorted(
            zip(plan_src[r, :n].tolist(), plan_dst[r, :n].tolist()))
        assert torch.equal(ps[r, n:], plan_src[r, n:]) and torch.equal(pd[r, n:], plan_dst[r, n:])
    src = random_rows(1000, 32, g)
    _, want = _strided_dst(10, 4, 32)
    _, got = _strided_dst(10, 4, 32)
    reference.ref_gather_compact(src, want, plan_src, plan_dst, plan_count)
    reference.ref_gather_compact(src, got, ps, pd, plan_count)
    assert torch.equal(want, got)


# ---------------------------------------------------------------------------
# K7 order_step + gather_ordered (docs/kernels.md P9)
# ---------------------------------------------------------------------------

def step_order_buffers(cells: int) -> dict[str, torch.Tensor]:
    """K7's outputs, poisoned so that a cell left unwritten shows."""
    bufs = {name: torch.full((cells,), POISON, dtype=I32)
            for name in ("keys", "cells", "sorted_keys", "sorted_cells")}
    bufs["total"] = torch.full((1,), POISON, dtype=I32)
    return bufs


def test_k7_order_step_lists_live_cells_by_host_row_across_rows():
    """P9 / INV-36, hand-worked: host_rows 100 -> 7 key bits, padding key
    127. Live cells (j < clamp(count, 0, K); counts 3, -2 and 9 > K) get key
    min(src, 126) (a negative source counts as past every row) and their
    cell id; the rest key 127 and id -1. The sorted list is the live cells
    in ascending key across all rows, equal keys in cell order (stable),
    then the padding; total is the live count; the plan is not changed."""
    plan_src = t32([[40, 7, -1, 99], [1, 2, 3, 4], [7, 500, 0, 55]])
    plan_dst = t32([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    plan_count = t32([3, -2, 9])
    ps, pd = plan_src.clone(), plan_dst.clone()
    b = step_order_buffers(12)
    reference.ref_order_step(ps, plan_count, 100, **b)
    assert reference.step_key_bits(100) == 7
    assert b["keys"].tolist() == [40, 7, 126, 127, 127, 127, 127, 127,
                                  7, 126, 0, 55]
    assert b["cells"].tolist() == [0, 1, 2, -1, -1, -1, -1, -1, 8, 9, 10, 11]
    assert b["sorted_keys"].tolist() == [0, 7, 7, 40, 55, 126, 126] + [127] * 5
    assert b["sorted_cells"].tolist() == [10, 1, 8, 0, 11, 2, 9] + [-1] * 5
    assert b["total"].tolist() == [7]
    assert torch.equal(ps, plan_src) and torch.equal(pd, plan_dst)


@pytest.mark.parametrize("host_rows, bits", [(0, 1), (1, 1), (2, 2), (3, 2),
                                             (4, 3), (2**31 - 1, 31)])
def test_k7_key_bits_keep_every_host_row_below_the_padding(host_rows, bits):
    """P9 / INV-14: the sort's bit count leaves the padding key 2^bits - 1
    above every row of the pool (rows < host_rows < 2^31)."""
    assert reference.step_key_bits(host_rows) == bits
    assert host_rows - 1 < (1 << bits) - 1


def test_k7_empty_plan_writes_nothing():
    """P9: a plan of no rows is a no-op (the kernel launches nothing)."""
    b = step_order_buffers(0)
    reference.ref_order_step(torch.zeros(0, 8, dtype=I32),
                             torch.zeros(0, dtype=I32), 1000, **b)
    assert b["total"].tolist() == [POISON]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k7_gather_ordered_writes_what_k2_writes_from_k1s_order(seed):
    """P9 / INV-36, INV-39: on fuzzed plans (counts negative to > K,
    negative sources, sources past the pool, tripped cells with dst -1,
    destinations past N*B) the sorted list holds exactly K2's cells, its
    live sources ascend, and K7's gather writes the slab K2 writes."""
    gen = torch.Generator().manual_seed(seed)
    rows, K, host_rows = 6, 24, 300
    plan_src, plan_dst, plan_count = random_plan(rows, K, host_rows, 400, gen)
    b = step_order_buffers(rows * K)
    reference.ref_order_step(plan_src, plan_count, host_rows, **b)
    used = torch.arange(K)[None, :] < plan_count.clamp(0, K)[:, None]
    total = int(b["total"][0])
    assert total == int(used.sum()) > 0
    listed = b["sorted_cells"][:total].long()
    assert sorted(listed.tolist()) == torch.nonzero(used.reshape(-1)).flatten().tolist()
    keys = b["sorted_keys"][:total]
    assert torch.all(keys[1:] >= keys[:-1])
    in_pool = plan_src.reshape(-1)[listed]
    in_pool = in_pool[(in_pool >= 0) & (in_pool < 511)]
    assert torch.all(in_pool[1:] >= in_pool[:-1])
    src = random_rows(host_rows, 32, gen)
    _, want = _strided_dst(10, 40, 32)
    _, got = _strided_dst(10, 40, 32)
    reference.ref_gather_compact(src, want, plan_src, plan_dst, plan_count)
    reference.ref_gather_ordered(src, got, plan_src, plan_dst,
                                 b["sorted_cells"], b["total"])
    assert torch.equal(want, got)


def test_k7_gather_ordered_skips_bad_entries_and_clamps_the_total():
    """P9 / INV-37: entries past the total, negative ids and ids past the
    plan are skipped, a total past the list is clamped to it, a negative
    total copies nothing (never an out-of-bounds read)."""
    plan_src = t32([[0, 1], [2, 3]])
    plan_dst = t32([[0, 1], [2, 3]])
    src = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)

    def gathered(order, total):
        base, dst = _strided_dst(1, 4, 16)
        reference.ref_gather_ordered(src, dst, plan_src, plan_dst,
                                     t32(order), t32([total]))
        return [bool((dst[0, r] == src[r]).all()) for r in range(4)]

    assert gathered([3, -1, 9, 0], 4) == [True, False, False, True]
    assert gathered([3, 1, 2, 0], 2) == [False, True, False, True]
    assert gathered([3, 1, 2, 0], 99) == [True] * 4
    assert gathered([3, 1, 2, 0], -5) == [False] * 4
