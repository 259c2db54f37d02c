# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU reference semantics of the HiSparse kernels (spec 5.6).

These functions are the oracles of the kernel tests: every output tensor and
the final ``dgi``/``lru`` of a kernel must equal theirs bit for bit. Each one
mirrors its op's signature and mutates the given CPU tensors in place, so a
test runs the op on GPU copies and the reference on CPU copies of the same
tensors and compares everything, including cells an op must leave alone.

Union groups are resolved one at a time, in row order, exactly as spec 5.1
steps 0-7 describe; the work *inside* a group is vectorised with torch ops
whose results do not depend on evaluation order (the tests cross-check this
module against a literal per-entry loop).

Decisions that complete the spec (docs/kernels.md lists them all):

- a request index outside ``[0, Rq)`` or a state slot outside ``[0, S)`` is
  padding, like -1 (memory safety, never an out-of-bounds read);
- a union group longer than ``max_query_len`` rows breaks the caller contract:
  its rows are written as padding and counted in ``stats[3]`` when present;
- block ids <= 0 are null in the source table and 0 is null in the resident
  table; GPU block ids (resident and hot tables) must lie in [1, N_gpu)
  (``num_gpu_blocks``), else the entry is tripped (F18): an invalid resident
  id resolves to -1 and is not pending; a miss whose victim's hot block is
  invalid is tripped like tripwire 2; a hit on such a slot resolves to -1
  and stays a hit for the LRU;
- row ids (block*Sa + offset, block*B + offset) are formed in int64 and an
  id that is not a non-negative int32 (only possible when the INV-14 range
  check is bypassed) resolves to -1 or trips, never wraps;
- ``resolved_g`` is the host row of entries served from the hot buffer and -1
  for everything else (resident, invalid, tripped, padding);
- plan cells past ``plan_count`` are not written; ``stats[2]`` (when present)
  counts every trip: tripped misses (per distinct host row, as tripwire 2
  always did) plus references that resolve to -1 because of an invalid GPU
  block id (resident entries, and hits on a slot with an invalid hot
  block).

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class UnionGroup:
    """A run of rows resolved together (spec 5.1 "Union groups")."""

    row0: int
    rows: int
    req: int  # -1 for padding rows
    state: int  # -1 for padding rows
    rejected: bool = False  # longer than max_query_len


def union_groups(row_req: torch.Tensor, req_state: torch.Tensor,
                 num_states: int, max_query_len: int) -> Iterator[UnionGroup]:
    """Split the batch rows into union groups and padding rows."""
    reqs = row_req.tolist()
    states = req_state.tolist()
    num_reqs = len(states)
    row = 0
    while row < len(reqs):
        req = reqs[row]
        if not 0 <= req < num_reqs:
            yield UnionGroup(row, 1, -1, -1)
            row += 1
            continue
        end = row + 1
        while end < len(reqs) and reqs[end] == req:
            end += 1
        state = states[req]
        if not 0 <= state < num_states:
            yield UnionGroup(row, end - row, -1, -1)
        else:
            yield UnionGroup(row, end - row, req, state,
                             rejected=end - row > max_query_len)
        row = end


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 with two's-complement wrap, as a C cast does."""
    wrapped = torch.remainder(values, 2**32)
    wrapped = torch.where(wrapped > INT32_MAX, wrapped - 2**32, wrapped)
    return wrapped.to(torch.int32)


def _attention_ids(block: torch.Tensor, offset: torch.Tensor,
                   attn_block_stride: int) -> torch.Tensor:
    """K3's out_rows: hma = block*Sa + offset in 64 bit, cast to int32 and
    then negative -> -1, as gather.cu does (K1 uses _checked_rows)."""
    ids = _to_int32(block.to(torch.int64) * attn_block_stride + offset)
    return torch.where(ids < 0, torch.full_like(ids, -1), ids)


def _checked_rows(block: torch.Tensor, offset: torch.Tensor, stride: int,
                  num_gpu_blocks: int) -> torch.Tensor:
    """block*stride + offset as int32 where the block id is in [1, N_gpu)
    and the int64 id fits a non-negative int32, else -1 (F18)."""
    block = block.to(torch.int64)
    ids = block * stride + offset.to(torch.int64)
    ok = ((block >= 1) & (block < num_gpu_blocks) & (ids >= 0)
          & (ids <= INT32_MAX))
    return torch.where(ok, ids, torch.full_like(ids, -1)).to(torch.int32)


def _table_lookup(table_row: torch.Tensor, page: torch.Tensor,
                  use: torch.Tensor) -> torch.Tensor:
    """table_row[page] where use & page < width, else 0 (null block)."""
    width = table_row.numel()
    ok = use & (page < width)
    if width == 0:
        return torch.zeros_like(page)
    vals = table_row.to(torch.int64)[page.clamp(0, width - 1)]
    return torch.where(ok, vals, torch.zeros_like(vals))


def _write_padding(g: UnionGroup, out_rows, valid_counts, plan_count,
                   miss_mask, resolved_g) -> None:
    rows = slice(g.row0, g.row0 + g.rows)
    out_rows[rows] = -1
    valid_counts[rows] = 0
    plan_count[rows] = 0
    if miss_mask is not None:
        miss_mask[rows] = 0
    if resolved_g is not None:
        resolved_g[rows] = -1


@dataclass
class _Entries:
    """Step 1 classification of a group's n*K entries, flat row-major."""

    out: torch.Tensor  # int32 final ids for resident/invalid, -1 elsewhere
    pending: torch.Tensor  # bool
    keys: torch.Tensor  # int64 host row g (meaningful where pending)
    trips: int  # resident entries with an invalid block id (F18)


def _classify(topk_rows: torch.Tensor, seq_len: int, src_row: torch.Tensor,
              res_row: torch.Tensor, host_rows: int, block_size: int,
              attn_block_stride: int, num_gpu_blocks: int) -> _Entries:
    p = topk_rows.reshape(-1).to(torch.int64)
    valid = (p >= 0) & (p < seq_len)
    page = torch.where(valid, p // block_size, torch.zeros_like(p))
    off = torch.where(valid, p % block_size, torch.zeros_like(p))
    res_block = _table_lookup(res_row, page, valid)
    # A non-zero resident entry is never a host read: a valid id resolves
    # through the resident table, any other id is tripped (-1).
    flagged = valid & (res_block != 0)
    res_ids = _checked_rows(res_block, off, attn_block_stride,
                            num_gpu_blocks)
    resident = flagged & (res_ids >= 0)
    src_block = _table_lookup(src_row, page, valid & ~flagged)
    keys = src_block * block_size + off
    pending = valid & ~flagged & (src_block > 0) & (keys < host_rows)
    out = torch.full_like(p, -1, dtype=torch.int32)
    out[resident] = res_ids[resident]
    return _Entries(out, pending, keys, int((flagged & ~resident).sum()))


@dataclass
class _Union:
    """Step 2: distinct pending keys in order of first occurrence."""

    keys: torch.Tensor  # int64 [|U|]
    entry_u: torch.Tensor  # union index of each pending entry
    entry_first: torch.Tensor  # bool: first reference of its key
    sorted_keys: torch.Tensor  # keys sorted ascending (for lookups)
    sorted_to_u: torch.Tensor  # union index of each sorted key


def _build_union(entries: _Entries) -> _Union:
    flat = torch.nonzero(entries.pending).flatten()
    keys = entries.keys[flat]
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    first = torch.full((uniq.numel(),), entries.pending.numel(),
                       dtype=torch.int64)
    first = first.scatter_reduce(0, inverse, flat, reduce="amin",
                                 include_self=True)
    order = torch.argsort(first)
    sorted_to_u = torch.empty_like(order)
    sorted_to_u[order] = torch.arange(order.numel())
    return _Union(keys=uniq[order], entry_u=sorted_to_u[inverse],
                  entry_first=flat == first[inverse], sorted_keys=uniq,
                  sorted_to_u=sorted_to_u)


def _lookup_union(union: _Union, values: torch.Tensor,
                  use: torch.Tensor) -> torch.Tensor:
    """Union index of each value found among the keys, else -1."""
    n = union.sorted_keys.numel()
    idx = torch.searchsorted(union.sorted_keys, values).clamp(max=n - 1)
    found = use & (values >= 0) & (union.sorted_keys[idx] == values)
    return torch.where(found, union.sorted_to_u[idx],
                       torch.full_like(values, -1))


def _hot_ids(hot_row: torch.Tensor, slots: torch.Tensor, stride: int,
             block_size: int, num_gpu_blocks: int) -> torch.Tensor:
    """Checked row ids hot_block*stride + offset of slots; -1 where the slot
    is negative (none) or its hot block / id is invalid (F18). Slots are in
    [0, H) or negative, so the hot-table index is in range."""
    some = slots >= 0
    s = torch.where(some, slots, torch.zeros_like(slots))
    blocks = hot_row.to(torch.int64)[s // block_size]
    ids = _checked_rows(blocks, s % block_size, stride, num_gpu_blocks)
    return torch.where(some, ids, torch.full_like(ids, -1))


def _resolve_group(g: UnionGroup, topk, seq_lens, src_bt, res_bt, hot_bt, dgi,
                   lru, host_rows, num_gpu_blocks, block_size,
                   attn_block_stride, out_rows, valid_counts, plan_src,
                   plan_dst, plan_count, miss_mask, resolved_g,
                   stats) -> None:
    K = topk.shape[1]
    H = dgi.shape[1]
    rows = slice(g.row0, g.row0 + g.rows)
    e = _classify(topk[rows], int(seq_lens[g.req]), src_bt[g.req],
                  res_bt[g.req], host_rows, block_size, attn_block_stride,
                  num_gpu_blocks)
    out = e.out
    resolved = torch.full_like(out, -1)
    missed = torch.zeros_like(out)
    if bool(e.pending.any()):
        union = _build_union(e)
        # Step 3: LRU classification in position order.
        lru_row = lru[g.state].to(torch.int64)
        dgi_row = dgi[g.state].to(torch.int64)
        in_range = (lru_row >= 0) & (lru_row < H)
        cached = torch.full_like(lru_row, -1)
        cached[in_range] = dgi_row[lru_row[in_range]]
        cand = _lookup_union(union, cached, in_range)
        positions = torch.arange(H)
        n_union = union.keys.numel()
        hit_pos = torch.full((n_union,), H, dtype=torch.int64)
        has = cand >= 0
        hit_pos = hit_pos.scatter_reduce(0, cand[has], positions[has],
                                         reduce="amin", include_self=True)
        is_hit = has & (hit_pos[cand.clamp(min=0)] == positions)
        hits = lru_row[is_hit]
        evictable = lru_row[~is_hit]
        slot_of_u = torch.full((n_union,), -1, dtype=torch.int64)
        slot_of_u[cand[is_hit]] = hits
        # Step 4: misses in U order take the oldest evictables.
        misses = torch.nonzero(hit_pos == H).flatten()
        n_miss = misses.numel()
        victims = evictable[:n_miss]
        # Tripwire 2 (victim outside [0, H)) and F18 (its hot block outside
        # [1, N_gpu), or a row id that does not fit int32): tripped.
        in_h = (victims >= 0) & (victims < H)
        v = torch.where(in_h, victims, torch.full_like(victims, -1))
        hot_row = hot_bt[g.req]
        dst = _hot_ids(hot_row, v, block_size, block_size, num_gpu_blocks)
        attn = _hot_ids(hot_row, v, attn_block_stride, block_size,
                        num_gpu_blocks)
        ok = in_h & (dst >= 0) & (attn >= 0)
        miss_keys = union.keys[misses]
        dgi[g.state, victims[ok]] = miss_keys[ok].to(torch.int32)
        slot_of_u[misses[ok]] = victims[ok]
        m = torch.arange(n_miss)
        plan_src[g.row0 + m // K, m % K] = miss_keys.to(torch.int32)
        plan_dst[g.row0 + m // K, m % K] = torch.where(
            ok, dst, torch.full_like(dst, -1))
        # Step 5: untouched evictables | refilled victims | hits.
        lru[g.state] = torch.cat(
            [evictable[n_miss:], victims, hits]).to(torch.int16)
        # Step 6: emit the hot rows of pending entries. A hit whose hot
        # block is invalid (F18) is served by nothing: -1, and a trip.
        ids_u = _hot_ids(hot_bt[g.req], slot_of_u, attn_block_stride,
                         block_size, num_gpu_blocks)
        pend = torch.nonzero(e.pending).flatten()
        ids = ids_u[union.entry_u]
        served = ids >= 0
        # Only hits can have a slot and no id (a miss's block was checked
        # above); each such reference is a trip.
        hit_trips = int(((slot_of_u[union.entry_u] >= 0) & ~served).sum())
        out[pend[served]] = ids[served]
        resolved[pend[served]] = e.keys[pend[served]].to(torch.int32)
        is_miss_u = torch.zeros(n_union, dtype=torch.bool)
        is_miss_u[misses] = True
        first_miss = served & union.entry_first & is_miss_u[union.entry_u]
        missed[pend[first_miss]] = 1
        if stats is not None:
            _add_stats(stats, int(is_hit.sum()), n_miss,
                       int((~ok).sum()) + hit_trips + e.trips)
    else:
        n_miss = 0
        if stats is not None and e.trips:
            _add_stats(stats, 0, 0, e.trips)
    out_rows[rows] = out.view(g.rows, K)
    valid_counts[rows] = (out.view(g.rows, K) >= 0).sum(1).to(torch.int32)
    left = n_miss - torch.arange(g.rows) * K
    plan_count[rows] = left.clamp(0, K).to(torch.int32)
    if miss_mask is not None:
        miss_mask[rows] = missed.view(g.rows, K)
    if resolved_g is not None:
        resolved_g[rows] = resolved.view(g.rows, K)


def _add_stats(stats: torch.Tensor, hits: int, misses: int,
               trips: int) -> None:
    """uint64 counters: hits, misses, then optionally trips."""
    counts = stats.view(torch.int64)
    counts[0] += hits
    counts[1] += misses
    if counts.numel() >= 3:
        counts[2] += trips


def ref_resolve(topk: torch.Tensor, row_req: torch.Tensor,
                seq_lens: torch.Tensor, req_state: torch.Tensor,
                src_bt: torch.Tensor, res_bt: torch.Tensor,
                hot_bt: torch.Tensor, dgi: torch.Tensor, lru: torch.Tensor,
                host_rows: int, block_size: int, attn_block_stride: int,
                max_query_len: int, out_rows: torch.Tensor,
                valid_counts: torch.Tensor, plan_src: torch.Tensor,
                plan_dst: torch.Tensor, plan_count: torch.Tensor,
                miss_mask: torch.Tensor | None = None,
                resolved_g: torch.Tensor | None = None,
                stats: torch.Tensor | None = None, *,
                num_gpu_blocks: int) -> None:
    """K1 resolve_residency on CPU tensors (same arguments as the launcher
    ``kernels.resolve_residency``). No argument validation: ids that the
    launcher's INV-14 checks exclude take the defensive -1 paths."""
    for g in union_groups(row_req, req_state, dgi.shape[0], max_query_len):
        if g.req < 0 or g.rejected:
            _write_padding(g, out_rows, valid_counts, plan_count, miss_mask,
                           resolved_g)
            if g.rejected and stats is not None and stats.numel() >= 4:
                stats.view(torch.int64)[3] += g.rows
            continue
        _resolve_group(g, topk, seq_lens, src_bt, res_bt, hot_bt, dgi, lru,
                       host_rows, num_gpu_blocks, block_size,
                       attn_block_stride, out_rows, valid_counts, plan_src,
                       plan_dst, plan_count, miss_mask, resolved_g, stats)


def _move_rows(src: torch.Tensor, dst: torch.Tensor, g: torch.Tensor,
               d: torch.Tensor) -> None:
    """Copy src rows g to dst rows d with the spec 5.0 skip/zero-fill rules."""
    rows_dst = dst.shape[0] * dst.shape[1]
    keep = (g >= 0) & (d >= 0) & (d < rows_dst)
    g, d = g[keep], d[keep]
    if d.numel() == 0:
        return
    from_src = g < src.shape[0]
    data = torch.zeros((d.numel(), dst.shape[2]), dtype=dst.dtype)
    data[from_src] = src[g[from_src]]
    # Advanced-index assignment writes through any block/row stride of the
    # view. Destinations of one call are distinct in every valid plan.
    block_rows = dst.shape[1]
    dst[d // block_rows, d % block_rows] = data


def ref_gather_compact(src: torch.Tensor, dst: torch.Tensor,
                       plan_src: torch.Tensor, plan_dst: torch.Tensor,
                       plan_count: torch.Tensor) -> None:
    """K2: copy the first clamp(plan_count[i], 0, K) plan entries of row i."""
    K = plan_src.shape[1]
    counts = plan_count.to(torch.int64).clamp(0, K)
    cols = torch.arange(K)
    use = cols[None, :] < counts[:, None]
    _move_rows(src, dst, plan_src[use].to(torch.int64),
               plan_dst[use].to(torch.int64))


def ref_order_plan(plan_src: torch.Tensor, plan_dst: torch.Tensor,
                   plan_count: torch.Tensor) -> None:
    """K6: each row's first clamp(plan_count[i], 0, K) cells sorted by
    source row, in place (a row's sources are distinct, so the order is
    unique); cells past the count untouched."""
    K = plan_src.shape[1]
    for i, n in enumerate(plan_count.to(torch.int64).clamp(0, K).tolist()):
        if n > 1:
            order = torch.argsort(plan_src[i, :n].to(torch.int64), stable=True)
            plan_src[i, :n] = plan_src[i, :n][order]
            plan_dst[i, :n] = plan_dst[i, :n][order]


def step_key_bits(host_rows: int) -> int:
    """K7 sorts on bits [0, bit_length(max(host_rows, 1))): every host row
    is below 2^bits - 1, the padding key."""
    return max(int(host_rows), 1).bit_length()


def ref_order_step_temp_bytes(cells: int, host_rows: int,
                              device=None) -> int:
    """The reference sorts with torch: no CUB temporary storage."""
    return 0


def ref_order_step(plan_src: torch.Tensor, plan_count: torch.Tensor,
                   host_rows: int, keys: torch.Tensor, cells: torch.Tensor,
                   sorted_keys: torch.Tensor, sorted_cells: torch.Tensor,
                   total: torch.Tensor, temp: torch.Tensor | None = None
                   ) -> None:
    """K7 order_step. Cell i = row*K + j of the plan is live when j <
    clamp(plan_count[row], 0, K). With pad = 2^step_key_bits(host_rows) - 1:
    keys[i] = min(src, pad - 1) for a live cell (a negative source counts as
    past every row) and pad otherwise; cells[i] = i if live else -1;
    sorted_keys/sorted_cells are the stable sort of (keys, cells) by key, so
    the live cells come first in ascending source order, ties in cell order;
    total[0] = the number of live cells. No plan cell changes. Nothing is
    written for an empty plan."""
    rows, K = plan_src.shape
    n = rows * K
    if n == 0:
        return
    pad = (1 << step_key_bits(host_rows)) - 1
    counts = plan_count.to(torch.int64).clamp(0, K)
    live = (torch.arange(K)[None, :] < counts[:, None]).reshape(-1)
    src = plan_src.reshape(-1).to(torch.int64)
    capped = torch.where((src >= 0) & (src < pad), src,
                         torch.full_like(src, pad - 1))
    k = torch.where(live, capped, torch.full_like(src, pad))
    ids = torch.where(live, torch.arange(n), torch.full_like(src, -1))
    order = torch.sort(k, stable=True).indices
    keys.copy_(k)
    cells.copy_(ids)
    sorted_keys.copy_(k[order])
    sorted_cells.copy_(ids[order])
    total[0] = int(counts.sum())


def ref_gather_ordered(src: torch.Tensor, dst: torch.Tensor,
                       plan_src: torch.Tensor, plan_dst: torch.Tensor,
                       order: torch.Tensor, total: torch.Tensor) -> None:
    """K7's gather: for the first clamp(total[0], 0, rows*K) entries c of
    ``order`` (order_step's sorted_cells) with 0 <= c < rows*K, K2's copy of
    plan cell c (src = plan_src.flat[c], dst = plan_dst.flat[c], spec 5.0's
    skip and zero-fill rules); other entries are skipped."""
    n = plan_src.numel()
    live = min(max(int(total[0]), 0), n)
    c = order[:live].to(torch.int64)
    c = c[(c >= 0) & (c < n)]
    _move_rows(src, dst, plan_src.reshape(-1)[c].to(torch.int64),
               plan_dst.reshape(-1)[c].to(torch.int64))


def ref_gather_plan(src: torch.Tensor, dst: torch.Tensor,
                    src_rows: torch.Tensor, dst_rows: torch.Tensor,
                    mask: torch.Tensor, req_state: torch.Tensor | None,
                    out_rows: torch.Tensor | None,
                    attn_block_stride: int) -> None:
    """K3: per-entry copy where mask is set; optional hma row ids."""
    rows = src_rows.shape[0]
    live = torch.ones(rows, dtype=torch.bool)
    if req_state is not None:
        live = req_state[:rows] >= 0
    d = dst_rows.to(torch.int64)
    if out_rows is not None:
        block_rows = dst.shape[1]
        ids = _attention_ids(torch.div(d, block_rows, rounding_mode="floor"),
                             d % block_rows, attn_block_stride)
        ids = torch.where(d < 0, torch.full_like(ids, -1), ids)
        out_rows.copy_(torch.where(live[:, None], ids,
                                   torch.full_like(ids, -1)))
    use = live[:, None] & (mask != 0)
    _move_rows(src, dst, src_rows[use].to(torch.int64), d[use])


def ref_invalidate(dgi: torch.Tensor, req_state: torch.Tensor,
                   token_req: torch.Tensor, written_g: torch.Tensor) -> None:
    """K4: clear dgi entries of each written token's slot equal to its row;
    ``dgi`` [S, H] (one index group) or [G, S, H] (every group alike)."""
    if dgi.dim() == 3:
        for group in dgi:
            ref_invalidate(group, req_state, token_req, written_g)
        return
    num_states, num_reqs = dgi.shape[0], req_state.shape[0]
    for r, g in zip(token_req.tolist(), written_g.tolist()):
        if not 0 <= r < num_reqs:
            continue
        s = int(req_state[r])
        if not 0 <= s < num_states or g < 0:
            continue
        row = dgi[s]
        row[row.to(torch.int64) == g] = -1


def ref_copy_descriptors(src_ptr: torch.Tensor, dst_ptr: torch.Tensor,
                         nbytes: torch.Tensor) -> None:
    """K5 on host addresses: memmove each (src, dst, nbytes) descriptor.

    Descriptors with a non-positive size or a null pointer are skipped, as
    in the kernel. Destinations must not overlap other descriptors.
    """
    for s, d, n in zip(src_ptr.tolist(), dst_ptr.tolist(), nbytes.tolist()):
        if n > 0 and s != 0 and d != 0:
            ctypes.memmove(d, s, n)


def ref_mirror_descriptors(resident_slots: list[torch.Tensor],
                           source_slots: torch.Tensor,
                           pair_of_layer: torch.Tensor,
                           src_base: torch.Tensor, dst_base: torch.Tensor,
                           src: torch.Tensor, dst: torch.Tensor,
                           nbytes: torch.Tensor, first: int, n: int,
                           block_size: int, bytes_per_block: int,
                           row_bytes: int) -> None:
    """K5b: descriptor l * n + t (layer l, token first + t) copies the
    token's row of resident group ``pair_of_layer[l]`` (slot r, in the slab)
    to its host row h = source_slots[first + t]: src = src_base[l] +
    (r // block_size) * bytes_per_block + (r % block_size) * row_bytes,
    dst = dst_base[l] + h * row_bytes, nbytes = row_bytes, or 0 where r or
    h is negative (padding; r and h clamp at 0 in the addresses)."""
    if n <= 0:
        return
    end = first + n
    resident = torch.stack([t[first:end] for t in resident_slots])
    per_layer = resident.index_select(0, pair_of_layer)  # [L, n]
    host = source_slots[first:end]
    valid = (per_layer >= 0) & (host >= 0).unsqueeze(0)
    rows = per_layer.clamp(min=0)
    src_off = (rows // block_size) * bytes_per_block + (rows % block_size) * row_bytes
    count = pair_of_layer.shape[0] * n
    torch.add(src_base.unsqueeze(1), src_off, out=src[:count].view(-1, n))
    torch.add(dst_base.unsqueeze(1), (host.clamp(min=0) * row_bytes).unsqueeze(0),
              out=dst[:count].view(-1, n))
    torch.mul(valid, row_bytes, out=nbytes[:count].view(-1, n))
