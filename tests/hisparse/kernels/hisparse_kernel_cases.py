# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builders shared by the kernel tests: resolver cases, a seeded fuzzer that
produces realistic and hostile inputs (padding, -1 and stale positions, null
pages, MTP unions, corrupted state and block tables), the F18 hand cases,
gather plans, and exact comparison.

A case holds CPU tensors; ``ResolveCase.to(device)`` clones it so the op and
the reference each run on their own copy of identical inputs and outputs.
Outputs start "poisoned" with a sentinel so a cell an op should not write (or
should have written) shows up in the comparison.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

POISON = -777
INPUT_NAMES = ("topk", "row_req", "seq_lens", "req_state", "src_bt", "res_bt",
               "hot_bt", "dgi", "lru")
OUTPUT_NAMES = ("out_rows", "valid_counts", "plan_src", "plan_dst",
                "plan_count", "miss_mask", "resolved_g", "stats")
COMPARED = OUTPUT_NAMES + ("dgi", "lru")


@dataclass
class ResolveCase:
    """All arguments of one resolve_residency call."""

    topk: torch.Tensor
    row_req: torch.Tensor
    seq_lens: torch.Tensor
    req_state: torch.Tensor
    src_bt: torch.Tensor
    res_bt: torch.Tensor
    hot_bt: torch.Tensor
    dgi: torch.Tensor
    lru: torch.Tensor
    host_rows: int
    block_size: int
    attn_block_stride: int
    max_query_len: int
    num_gpu_blocks: int  # N_gpu: resident/hot block ids are valid in [1, N)
    out_rows: torch.Tensor = None
    valid_counts: torch.Tensor = None
    plan_src: torch.Tensor = None
    plan_dst: torch.Tensor = None
    plan_count: torch.Tensor = None
    miss_mask: torch.Tensor | None = None
    resolved_g: torch.Tensor | None = None
    stats: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.out_rows is None:
            self.reset_outputs()

    def reset_outputs(self, stats_len: int = 4) -> None:
        """Poisoned outputs and zeroed uint64 counters."""
        R, K = self.topk.shape
        dev = self.topk.device
        full = lambda *shape: torch.full(shape, POISON, dtype=torch.int32,
                                         device=dev)
        self.out_rows, self.plan_src, self.plan_dst = (full(R, K),
                                                       full(R, K), full(R, K))
        self.miss_mask, self.resolved_g = full(R, K), full(R, K)
        self.valid_counts, self.plan_count = full(R), full(R)
        self.stats = torch.zeros(stats_len, dtype=torch.uint64, device=dev)

    def with_state(self, dgi: torch.Tensor, lru: torch.Tensor) -> ResolveCase:
        return dataclasses.replace(self, dgi=dgi, lru=lru)

    def to(self, device) -> ResolveCase:
        """A deep copy on ``device``."""
        moved = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            moved[f.name] = (v.to(device, copy=True)
                             if isinstance(v, torch.Tensor) else v)
        return ResolveCase(**moved)

    def args(self) -> tuple:
        """Positional arguments of the launcher and of ref_resolve (both
        also take ``num_gpu_blocks`` by keyword: ``kwargs()``)."""
        return (self.topk, self.row_req, self.seq_lens, self.req_state,
                self.src_bt, self.res_bt, self.hot_bt, self.dgi, self.lru,
                self.host_rows, self.block_size, self.attn_block_stride,
                self.max_query_len, self.out_rows, self.valid_counts,
                self.plan_src, self.plan_dst, self.plan_count,
                self.miss_mask, self.resolved_g, self.stats)

    def kwargs(self) -> dict:
        return {"num_gpu_blocks": self.num_gpu_blocks}

    def op_args(self) -> tuple:
        """Arguments of torch.ops.hisparse_ops.resolve_residency, whose
        schema takes num_gpu_blocks right after host_rows."""
        a = self.args()
        return a[:10] + (self.num_gpu_blocks,) + a[10:]

    @property
    def stat_values(self) -> list[int]:
        return self.stats.cpu().view(torch.int64).tolist()


def run_reference(case: ResolveCase) -> ResolveCase:
    from vllm.v1.hisparse import reference
    reference.ref_resolve(*case.args(), **case.kwargs())
    return case


def run_kernel(kernels, case: ResolveCase) -> ResolveCase:
    """The launcher (``vllm.v1.hisparse.kernels``) on a CUDA case."""
    kernels.resolve_residency(*case.args(), **case.kwargs())
    return case


def as_comparable(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.int64) if t.dtype == torch.uint64 else t


def assert_same_tensor(name: str, got: torch.Tensor, want: torch.Tensor,
                       label: str = "") -> None:
    got, want = as_comparable(got), as_comparable(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{label}{name}: {got.dtype}{tuple(got.shape)} vs "
        f"{want.dtype}{tuple(want.shape)}")
    if torch.equal(got, want):
        return
    diff = torch.nonzero(got != want)
    first = tuple(diff[0].tolist())
    raise AssertionError(
        f"{label}{name}: {diff.shape[0]} cell(s) differ; first at {first}: "
        f"got {got[first].item()} want {want[first].item()}")


def assert_same_case(got: ResolveCase, want: ResolveCase,
                     label: str = "") -> None:
    """Every output, the final dgi/lru and the counters, bit for bit."""
    for name in COMPARED:
        assert_same_tensor(name, getattr(got, name), getattr(want, name),
                           label)


# ---------------------------------------------------------------------------
# Fuzzer
# ---------------------------------------------------------------------------

@dataclass
class FuzzSpec:
    top_k: int
    hot_size: int
    block_size: int = 16
    attn_block_stride: int | None = None  # default: 3*B (flat-like)
    max_query_len: int = 1
    num_reqs: int = 4
    num_states: int = 6
    max_pages: int = 0  # 0: enough for ~3x top_k positions
    padding_rows: int = 2
    padding_reqs: int = 1  # requests whose state slot is -1
    resident_frac: float = 0.2
    null_frac: float = 0.05
    invalid_frac: float = 0.04  # -1 entries
    stale_frac: float = 0.03  # positions >= seq_len
    dup_frac: float = 0.05  # repeated positions within a row
    host_overflow: bool = True  # some host blocks past host_rows
    corrupt: bool = False
    corrupt_tables: bool = False  # F18: bad resident/hot block ids per step
    groups_full: bool = False  # every request uses max_query_len rows
    seed: int = 0
    extra: dict = field(default_factory=dict)


class ResolveFuzzer:
    """A fixed batch layout (requests, tables, state slots) plus fresh top-k
    rows per step; ``overlap`` of each request's previous positions is reused
    so warm steps hit the hot buffer."""

    def __init__(self, spec: FuzzSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.gen = torch.Generator().manual_seed(spec.seed)
        s = spec
        self.B = s.block_size
        self.Sa = s.attn_block_stride or 3 * s.block_size
        pages = s.max_pages or max(3, -(-3 * s.top_k // self.B) + 2)
        self.max_pages = pages
        self._build_tables(pages)
        self.prev: dict[int, list[int]] = {}
        self.dgi = torch.full((s.num_states, s.hot_size), -1,
                              dtype=torch.int32)
        self.lru = torch.arange(s.hot_size, dtype=torch.int16).repeat(
            s.num_states, 1)
        self.row_req = self._layout_rows()

    def _build_tables(self, pages: int) -> None:
        s, rng = self.spec, self.rng
        R = s.num_reqs
        hot_w = -(-s.hot_size // self.B) + rng.randint(0, 1)
        n_host = R * pages + 8
        self.host_rows = n_host * self.B
        host_ids = list(range(1, n_host + (4 if s.host_overflow else 0)))
        rng.shuffle(host_ids)
        self.num_gpu_blocks = R * (pages + hot_w) + 16
        gpu_ids = list(range(1, self.num_gpu_blocks))
        rng.shuffle(gpu_ids)
        self.seq_lens = torch.zeros(R, dtype=torch.int32)
        # The resident table is sometimes narrower than the context so the
        # "page < Mr" guard is exercised.
        res_w = pages - (1 if rng.random() < 0.5 else 0)
        self.src_bt = torch.zeros(R, pages, dtype=torch.int32)
        self.res_bt = torch.zeros(R, res_w, dtype=torch.int32)
        self.hot_bt = torch.zeros(R, hot_w, dtype=torch.int32)
        for r in range(R):
            n_pages = rng.randint(max(1, pages // 2), pages)
            seq = (n_pages - 1) * self.B + rng.randint(1, self.B)
            self.seq_lens[r] = seq
            for p in range(n_pages):
                if rng.random() >= s.null_frac:
                    self.src_bt[r, p] = host_ids.pop()
                tail = p >= n_pages - 2
                if p < res_w and (tail or rng.random() < s.resident_frac):
                    self.res_bt[r, p] = gpu_ids.pop()
            for j in range(hot_w):
                self.hot_bt[r, j] = gpu_ids.pop()
        states = list(range(s.num_states))
        rng.shuffle(states)
        states += [-1] * max(0, R - len(states))  # more requests than slots
        self.req_state = torch.tensor(states[:R], dtype=torch.int32)
        for r in rng.sample(range(R), min(s.padding_reqs, R)):
            self.req_state[r] = -1

    def _layout_rows(self) -> torch.Tensor:
        """Union groups of 1..q rows per request, padding rows between."""
        s, rng = self.spec, self.rng
        order = list(range(s.num_reqs))
        rng.shuffle(order)
        rows: list[int] = []
        pads = s.padding_rows
        for r in order:
            if pads and rng.random() < 0.5:
                rows.append(-1 if rng.random() < 0.7 else s.num_reqs + 3)
                pads -= 1
            n = s.max_query_len if s.groups_full else rng.randint(
                1, s.max_query_len)
            rows += [r] * n
        rows += [-1] * pads
        return torch.tensor(rows, dtype=torch.int32)

    def _positions(self, r: int, overlap: float) -> list[int]:
        """K positions of request r: reuse, fresh, -1, stale, duplicates."""
        s, rng = self.spec, self.rng
        seq = int(self.seq_lens[r])
        prev = self.prev.get(r, [])
        k = s.top_k
        keep = [p for p in prev if p >= 0 and rng.random() < overlap][:k]
        fresh = rng.sample(range(seq), min(seq, k))
        kept = set(keep)
        out = (keep + [p for p in fresh if p not in kept])[:k]
        out += [-1] * (k - len(out))
        for i in range(k):
            x = rng.random()
            if x < s.invalid_frac:
                out[i] = -1
            elif x < s.invalid_frac + s.stale_frac:
                out[i] = seq + rng.randint(0, 3 * self.B)
            elif x < s.invalid_frac + s.stale_frac + s.dup_frac and i:
                out[i] = out[rng.randrange(i)]
        rng.shuffle(out)
        return out

    def step(self, overlap: float = 0.7) -> ResolveCase:
        """Inputs of the next step; dgi/lru are this fuzzer's CPU state."""
        s, rng = self.spec, self.rng
        rows = self.row_req.tolist()
        topk = torch.empty(len(rows), s.top_k, dtype=torch.int32)
        new_prev: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if 0 <= r < s.num_reqs and r in new_prev:
                # Another MTP row: mostly the same positions, some new.
                base = self._positions(r, overlap)
                shared = new_prev[r]
                row = [shared[j] if rng.random() < 0.6 else base[j]
                       for j in range(s.top_k)]
            elif 0 <= r < s.num_reqs:
                row = self._positions(r, overlap)
                new_prev[r] = row
            else:
                row = [rng.randint(-1, 50) for _ in range(s.top_k)]
            topk[i] = torch.tensor(row, dtype=torch.int32)
        self.prev.update(new_prev)
        case = ResolveCase(
            topk=topk, row_req=self.row_req.clone(),
            seq_lens=self.seq_lens.clone(), req_state=self.req_state.clone(),
            src_bt=self.src_bt.clone(), res_bt=self.res_bt.clone(),
            hot_bt=self.hot_bt.clone(), dgi=self.dgi.clone(),
            lru=self.lru.clone(), host_rows=self.host_rows,
            block_size=self.B, attn_block_stride=self.Sa,
            max_query_len=s.max_query_len,
            num_gpu_blocks=self.num_gpu_blocks)
        if s.corrupt:
            corrupt_state(case, rng)
        if s.corrupt_tables:
            corrupt_tables(case, rng)
        return case

    def adopt_state(self, case: ResolveCase) -> None:
        """Continue from the state a (reference) step produced."""
        self.dgi = case.dgi.detach().cpu().clone()
        self.lru = case.lru.detach().cpu().clone()


def corrupt_state(case: ResolveCase, rng: random.Random) -> None:
    """Tripwire fodder (INV-37): out-of-range LRU slots, and dgi entries that
    duplicate a key, hold garbage or hold a key that is about to be asked
    for. LRU rows stay free of duplicated in-range slots (see docs)."""
    S, H = case.lru.shape
    for s in range(S):
        for _ in range(rng.randint(0, 3)):
            pos = rng.randrange(H)
            case.lru[s, pos] = rng.choice([H, H + 7, -1, -300, 32767])
        for _ in range(rng.randint(0, 3)):
            slot = rng.randrange(H)
            other = int(case.dgi[s, rng.randrange(H)])
            case.dgi[s, slot] = rng.choice([other, -5, 2**31 - 1,
                                            rng.randint(0, 10**6)])


def corrupt_tables(case: ResolveCase, rng: random.Random) -> None:
    """F18 fodder: resident and hot block ids outside [1, N_gpu) (0 in the
    hot table, N_gpu, negative, int32 extremes whose row ids overflow), and
    now and then a request whose hot table is all null."""
    n = case.num_gpu_blocks
    reqs = case.hot_bt.shape[0]
    bad = [0, n, n + 3, -1, -(2**31), 2**31 - 1, 2**31 // 3 + 1]
    for r in range(reqs):
        if rng.random() < 0.15:
            case.hot_bt[r] = 0
            continue
        for _ in range(rng.randint(0, 2)):
            j = rng.randrange(case.hot_bt.shape[1])
            case.hot_bt[r, j] = rng.choice(bad)
        if case.res_bt.shape[1]:
            for _ in range(rng.randint(0, 3)):
                j = rng.randrange(case.res_bt.shape[1])
                case.res_bt[r, j] = rng.choice(bad[1:])  # 0 is "not resident"


# ---------------------------------------------------------------------------
# F18 hand cases (B = 4, Sa = 6, H = 8, src blocks 5..8, N_gpu = 64), shared
# by the CPU test (hand-computed values) and the GPU test (kernel == ref).
# topk [9, 2, 14, 5] -> host rows 29, 22, 34, 25; 0, 1 -> 20, 21.
# ---------------------------------------------------------------------------

F18_GPU_BLOCKS = 64


def small_case(topk_rows, *, hot=8, block=4, sa=6, q=1, src=(5, 6, 7, 8),
               res=(0, 0, 0, 0), hot_blocks=(10, 11), seq_len=16,
               host_rows=1000, dgi=None, lru=None,
               num_gpu_blocks=F18_GPU_BLOCKS) -> ResolveCase:
    """Request 0 in state slot 0; one row per entry of ``topk_rows``."""
    t32 = lambda rows: torch.tensor(rows, dtype=torch.int32)
    if dgi is None:
        dgi = torch.full((1, hot), -1, dtype=torch.int32)
    if lru is None:
        lru = torch.arange(hot, dtype=torch.int16).view(1, hot)
    return ResolveCase(
        topk=t32(topk_rows), row_req=t32([0] * len(topk_rows)),
        seq_lens=t32([seq_len]), req_state=t32([0]), src_bt=t32([list(src)]),
        res_bt=t32([list(res)]), hot_bt=t32([list(hot_blocks)]), dgi=dgi,
        lru=lru, host_rows=host_rows, block_size=block, attn_block_stride=sa,
        max_query_len=q, num_gpu_blocks=num_gpu_blocks)


def warm_state() -> tuple[torch.Tensor, torch.Tensor]:
    """State after a cold [9, 2, 14, 5] with hot blocks (10, 11):
    dgi = [29, 22, 34, 25, -1 x4], lru = [4, 5, 6, 7, 0, 1, 2, 3]."""
    dgi = torch.tensor([[29, 22, 34, 25, -1, -1, -1, -1]], dtype=torch.int32)
    lru = torch.tensor([[4, 5, 6, 7, 0, 1, 2, 3]], dtype=torch.int16)
    return dgi, lru


def f18_cases() -> dict[str, ResolveCase]:
    """Fresh copies of the F18 cases (all ids within the launcher's INV-14
    range, so the GPU runs them too)."""
    n = F18_GPU_BLOCKS
    dgi, lru = warm_state()
    return {
        # Null hot table, cold: every miss trips.
        "null_hot_cold": small_case([[9, 2, 14, 5]], hot_blocks=(0, 0)),
        # Null hot table, warm: hits 22, 29 cannot be read, misses trip.
        "null_hot_warm": small_case([[2, 3, 9, 13]], hot_blocks=(0, 0),
                                    dgi=dgi.clone(), lru=lru.clone()),
        # Hot block N_gpu - 1 is valid, N_gpu is not.
        "hot_id_n_gpu": small_case([[9, 2, 14, 5, 0, 1]],
                                   hot_blocks=(n - 1, n)),
        # A negative hot block id under warm hits (slots 0..3 in block 10).
        "hot_id_negative": small_case([[2, 3, 9, 13]], hot_blocks=(10, -3),
                                      dgi=dgi.clone(), lru=lru.clone()),
        # Hits whose hot block became invalid keep their LRU position; 22
        # is referenced twice (two trips).
        "hot_hit_invalid": small_case([[2, 9, 2]], hot_blocks=(n + 5, 11),
                                      dgi=dgi.clone(), lru=lru.clone()),
        # Resident id N_gpu next to a host-backed page (not pending).
        "res_id_n_gpu": small_case([[9, 2]], res=(0, 0, n, 0)),
        # Only invalid resident ids (int32 max, -1, one whose id*Sa
        # overflows int32, N_gpu) and one valid: resident short-circuit.
        "res_ids_huge": small_case([[2, 5, 9, 14, 15]],
                                   res=(2**31 - 1, -1, 2**31 // 6 + 1, n),
                                   src=(5, 6, 7, 8),
                                   dgi=dgi.clone(), lru=lru.clone()),
        "res_ids_mixed": small_case([[2, 5, 9, 14]],
                                    res=(2**31 - 1, -1, 2**31 // 6 + 1, 3),
                                    dgi=dgi.clone(), lru=lru.clone()),
    }


# ---------------------------------------------------------------------------
# Gather plans
# ---------------------------------------------------------------------------

def random_rows(n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), dtype=torch.uint8,
                         generator=gen)


def random_plan(rows: int, top_k: int, src_rows: int, dst_rows: int,
                gen: torch.Generator, *, negatives: bool = True,
                overflow: bool = True) -> tuple[torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    """A gather plan with distinct destinations, counts over the whole range
    (negative, 0, mid, K, > K), negative ids and zero-fill sources."""
    n = rows * top_k
    assert n <= dst_rows, "plan needs distinct destinations"
    dst = torch.randperm(dst_rows, generator=gen)[:n].to(torch.int32)
    src = torch.randint(0, src_rows, (n,), generator=gen, dtype=torch.int32)
    if overflow:
        over = torch.rand(n, generator=gen) < 0.05
        src[over] = src_rows + torch.randint(0, 9, (int(over.sum()),),
                                             generator=gen,
                                             dtype=torch.int32)
    if negatives:
        neg = torch.rand(n, generator=gen) < 0.04
        src[neg] = -1
        neg = torch.rand(n, generator=gen) < 0.04
        dst[neg] = -3
        far = torch.rand(n, generator=gen) < 0.03
        dst[far] = dst_rows + 5
    choices = torch.tensor([-2, 0, 1, top_k // 2, top_k, top_k + 9],
                           dtype=torch.int32)
    counts = choices[torch.randint(0, len(choices), (rows,), generator=gen)]
    return (src.view(rows, top_k), dst.view(rows, top_k), counts)


def mirror_case(seed: int, groups: int = 4, layers_per_group: int = 2,
                max_tokens: int = 96, block_size: int = 64) -> dict:
    """Inputs of K5b (mirror_descriptors) as the worker passes them: the
    resident groups' slot mappings (-1 = padding), the source group's, the
    layers' groups and byte bases, for a slab of 656-B rows."""
    gen = torch.Generator().manual_seed(seed)
    row_bytes = 656
    slots = [torch.randint(-1, 40 * block_size, (max_tokens,), dtype=torch.int64,
                           generator=gen) for _ in range(groups)]
    source = torch.randint(-1, 5000, (max_tokens,), dtype=torch.int64, generator=gen)
    pair = torch.arange(groups, dtype=torch.int64).repeat_interleave(layers_per_group)
    layers = pair.shape[0]
    return dict(resident_slots=slots, source_slots=source, pair_of_layer=pair,
                src_base=torch.randint(1 << 40, 1 << 41, (layers,), dtype=torch.int64,
                                       generator=gen),
                dst_base=torch.randint(1 << 42, 1 << 43, (layers,), dtype=torch.int64,
                                       generator=gen),
                src=torch.full((layers * max_tokens,), -7, dtype=torch.int64),
                dst=torch.full((layers * max_tokens,), -7, dtype=torch.int64),
                nbytes=torch.full((layers * max_tokens,), -7, dtype=torch.int64),
                block_size=block_size, bytes_per_block=block_size * row_bytes + 128,
                row_bytes=row_bytes)


def mirror_case_to(case: dict, device: str) -> dict:
    return {k: ([t.to(device) for t in v] if isinstance(v, list)
                else v.to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in case.items()}
