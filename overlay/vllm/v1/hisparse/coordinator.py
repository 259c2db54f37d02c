# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C4: the scheduler-side residency state machine (spec 2.5, 4.1-4.8, 4.15).

The pinned host pool is the source of truth; a request's resident pages are a
write-back cache of it. Per request, each page moves

    DIRTY -> PENDING -> CLEAN_PINNED -> CLEAN_UNPINNED -> LOST

- DIRTY: GPU only, the request holds the resident blocks.
- PENDING: a spill (transfer) is in flight; the transfer holds extra leases
  on both endpoints until every worker that enqueued it has completed it.
- CLEAN_PINNED: the host copy is valid (``valid``); the request still holds
  the blocks.
- CLEAN_UNPINNED: the request released the blocks with ``unpin_blocks``; they
  count as free but stay readable until the pool reuses them.
- LOST: the pool reused a block; every resident group's entry becomes the
  null block and the page is read from host through the hot buffer.

This class owns logical host identity: which host block backs which page,
what may be published to the prefix cache (only durable pages), which GPU
blocks hold clean copies of published host blocks (``copies``) and who owns
an unpinned block (``owners``). It never touches bytes: it emits transfers,
residency updates, CoW pairs and the step's block events (new host blocks,
reused GPU blocks, hot regions) for the worker as flat arrays (INV-2,
``vllm.v1.hisparse.metadata``), and it consumes the worker's acks.

Hot path: residency is event-driven. A request's full pass
(``advance_scheduled``: materialize, adopt, unpin, transition checks) runs
only when something it depends on changed: a new full page, an allocation
(table growth, a hot region), a lost or adopted page, a hot transition, a
spill backlog. Otherwise the request is *settled* and its per-step cost is
one comparison here and one in each KV-cache coordinator hook (``room``).
Acks act on the requests they name (``update_spills``). The free-block
watermark is checked once per step (``build_step_metadata``), which visits
only the requests whose resident table changed (``_dirty``). Loops run over
pages, never over tokens.
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.hisparse.block_pool import UnpinBlockPool
from vllm.v1.hisparse.constants import ACTIVE_TAIL_PAGES, MAX_PUBLICATION_WAITS
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck, empty_ids
from vllm.v1.hisparse.pd_imports import ImportPlan, ImportTracker
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.managers import (
        HiSparseHotManager,
        HiSparseResidentManager,
        HiSparseSourceManager,
    )


logger = init_logger(__name__)

_CLEAN = sys.maxsize  # RequestResidency.dirty_from when the worker's table is current
_request_id = attrgetter("request_id")


def durable_tokens(request: Request) -> int:
    """Tokens whose KV a finished request's completed forwards wrote: all but
    the last sampled one (never computed), and no more than it computed (an
    abort mid-prefill). R31 keeps the spills of their full pages."""
    return max(0, min(request.num_computed_tokens, request.num_tokens - 1))


@dataclass(eq=False)
class RequestResidency:
    """Per-request residency state (spec 2.5). Identity is the incarnation:
    a preempted request that is admitted again gets a new object, so a late
    ack for the old one never touches the new one (4.3)."""

    request_id: str
    request: Request | None = None
    valid: set[int] = field(default_factory=set)
    """Pages whose host copy is complete (INV-1)."""
    ready_prefix: int = 0
    """Length of the contiguous valid prefix, in pages."""
    next_plan: int = 0
    """Every page below this one is pending or valid (materialization cursor)."""
    pending: dict[int, int] = field(default_factory=dict)
    """page -> transfer id in flight."""
    pinned_clean: set[int] = field(default_factory=set)
    unpinned: set[int] = field(default_factory=set)
    pages_to_adopt: int = 0
    copies_recorded: int = 0
    dirty_from: int = _CLEAN
    """First page whose resident entry changed since the worker last saw it
    (``_CLEAN`` when none); a state with a change is in the coordinator's
    ``_dirty`` set until the update is sent."""
    publication: int | None = None
    """Tokens the source manager asked to publish (4.4); None when none."""
    hot_required: bool = False
    hot_ready: bool = False
    """The hot region is complete (cached: it never shrinks while live)."""
    detached: "DetachedPublication | None" = None
    loading: bool = False
    """Admitted to load its external (offloaded indexer) KV asynchronously:
    it runs no forward until the load ends, so it gets no hot region yet
    (a region is a worker state slot, and only max_num_seqs exist)."""
    settled_pages: int = -1
    """Full pages at the last full pass, when nothing else is due; -1 makes
    the next scheduling pass run the full residency step."""
    room: int = 0
    """Tokens every group's table holds with no allocation in any group,
    set by the KV-cache coordinator after a full pass; 0 when unknown or
    while a hot region is due."""
    importing: ImportPlan | None = None
    """A P/D import in flight (``ImportTracker.begin_import``): its pages are
    neither valid nor read until the import completes (INV-30)."""

    def unsettle(self) -> None:
        """Something changed: the next pass runs in full and allocates."""
        self.settled_pages = -1
        self.room = 0


@dataclass(eq=False)
class DetachedPublication:
    """A request that finished with spills pending (4.4 step 4): its host
    blocks are leased until the spills land, then the durable prefix is
    published exactly once (INV-19)."""

    request: Request
    host_blocks: list[KVCacheBlock]
    num_pages: int
    num_cached_pages: int
    pending_hashes: tuple = ()
    """The block hashes of pages [num_cached_pages, num_pages): what the
    publication will add (R30: admissions that reach them wait)."""


@dataclass(eq=False)
class Spill:
    """A transfer in flight (spec 2.5 ``pending_spills``)."""

    transfer_id: int
    state: RequestResidency
    page: int
    host_block: KVCacheBlock
    resident_blocks: tuple[KVCacheBlock, ...]
    restore: bool = False
    enqueued: frozenset[int] = frozenset()
    completed: frozenset[int] = frozenset()
    planned_step: int = 0
    """The step whose metadata carried the transfer (0: not sent yet). The
    forward of that step writes (or wrote) the page's last rows (F17)."""
    submitted_step: int | None = None
    """The step after whose forward the workers submitted it, as last reported."""


@dataclass
class HiSparseSchedulerStats:
    """Scheduler-side counters (spec 6.5)."""

    lost_pages: int = 0
    spills_planned: int = 0
    spills_completed: int = 0
    spills_cancelled: int = 0
    """Planned, then dropped before any worker saw them (R15)."""
    completions_ignored: int = 0
    """Completions reported for a submission before the planned step (F17)."""
    reader_reports_ignored: int = 0
    """Spill reports from a non-writer rank of a shared host pool (INV-28)."""
    pages_unpinned: int = 0
    pages_adopted: int = 0
    pages_unpinned_to_allocate: int = 0
    """Clean pages a request gave up inside its own allocation (R25)."""
    waits_for_in_flight: int = 0
    """Scheduling attempts that waited for in-flight copies instead of
    preempting (R26)."""
    admission_backoffs: int = 0
    """Steps on which the waiting head was not looked up again: the blocks
    available to it were no more than when it last failed (R35)."""
    staging_deferrals: int = 0
    """Short chunks deferred a step because this step's staged pages would
    exceed the in-slab staging blocks (R28, F21)."""
    publication_waits: int = 0
    """Admissions deferred a step because the request's next page is about
    to be published by a finished request (R30)."""
    import_device_pages: int = 0
    """P/D-imported pages that landed in resident GPU pages (4.13)."""
    import_host_pages: int = 0
    """P/D-imported pages that landed in the host pool (4.13)."""
    import_waits: int = 0
    """Admissions deferred a step because neither landing of their import
    fitted (4.13 "not admissible"; never a preemption, INV-30)."""
    import_fallbacks: int = 0
    """Imports given up for recomputation: waited MAX_IMPORT_WAITS attempts,
    or the load failed (4.13 step 5)."""


class HiSparseCoordinator:
    """Residency state machine of one scheduler (spec C4).

    Invariants kept (tests cite them): INV-1/INV-17 (valid only after every
    enqueuing worker completed), INV-6 (every computed page has a host block;
    enforced by the source manager's allocation), INV-7 (a page is resident in
    all resident groups or none), INV-16 (sealed pages only, one transfer per
    page, a per-step budget), INV-18/19 (publish only the durable prefix;
    preempted requests never publish more; finished ones publish once), INV-20
    (unpin only valid, idle, non-tail pages of requests that can read from
    host), INV-21 (no unpinned page without a hot region), INV-22/23 (reuse
    nulls exactly the owners and drops the copies entry; adoption only into
    null entries).
    """

    def __init__(
        self,
        *,
        gpu_pool: UnpinBlockPool,
        host_pool: BlockPool,
        block_size: int,
        max_model_len: int,
        cap_res_pages: int,
        hot_blocks_per_request: int,
        host_writer_rank: int | None = None,
        max_in_flight_tokens: int = 0,
    ) -> None:
        self.gpu_pool = gpu_pool
        # Shared host pool (4.12): only this rank's spill reports count
        # (INV-28); None: private pools, every rank copies and reports.
        self._spill_reporters = (
            None if host_writer_rank is None else frozenset((host_writer_rank,))
        )
        self.host_pool = host_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.cap_res_pages = cap_res_pages
        self.hot_blocks_per_request = hot_blocks_per_request
        self.num_gpu_blocks = gpu_pool.num_gpu_blocks
        # Spec 4.5: max(per-request hot cost, 10% of the pool).
        self.transition_watermark = max(
            hot_blocks_per_request, self.num_gpu_blocks // 10
        )
        # INV-16's per-step cap, at least what the steps in flight can seal
        # (R32): below it a backlog forms whenever the batched tokens exceed
        # max_model_len, and a request that finishes before its pages are
        # planned never publishes them (its next turn recomputes).
        self.spill_budget = max(max_model_len, max_in_flight_tokens) // block_size

        self.source: HiSparseSourceManager
        self.residents: tuple[HiSparseResidentManager, ...] = ()
        self.hots: tuple[HiSparseHotManager, ...] = ()

        self.states: dict[str, RequestResidency] = {}
        self.step = 0
        """The last step whose metadata was built (the first step is 1)."""
        self.pending_spills: dict[int, Spill] = {}
        self._spills_to_send: list[Spill] = []
        self._retired: list[int] = []
        self._next_transfer_id = 1
        # Live states whose resident table changed since the worker saw it
        # (an ordered set: dicts keep insertion order, so metadata is
        # deterministic).
        self._dirty: dict[RequestResidency, None] = {}
        # Published host block hash -> one GPU block per resident group.
        self.copies: dict[object, tuple[KVCacheBlock, ...]] = {}
        self._copy_of_block: dict[int, object] = {}
        # Unpinned GPU block id -> {(request state, page)} reading it.
        self.owners: dict[int, set[tuple[RequestResidency, int]]] = {}
        self._new_source_block_ids: list[int] = []
        # This step's hot-region events (first block ids, in order).
        self._hot_allocated: dict[int, str] = {}  # first block -> request
        self._hot_freed: list[int] = []
        self._cow_pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._cow_in_flight: dict[int, tuple[KVCacheBlock, KVCacheBlock]] = {}
        # R30: block hash -> detached publications that will publish it;
        # request id -> the attempts it has waited so far
        self._publishing: dict[object, int] = {}
        self._publication_waits: dict[str, int] = {}
        self.imports = ImportTracker(self)
        """P/D imports (4.13): the importing connector drives their lifecycle."""
        self.stats = HiSparseSchedulerStats()

    def bind_managers(
        self,
        source: "HiSparseSourceManager",
        residents: Sequence["HiSparseResidentManager"],
        hots: Sequence["HiSparseHotManager"],
    ) -> None:
        self.source = source
        self.residents = tuple(residents)
        self.hots = tuple(hots)

    # ------------------------------------------------------------ lookups

    def _state(self, request_id: str) -> RequestResidency:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = RequestResidency(request_id)
        return st

    def _tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        return [m.req_to_blocks[request_id] for m in self.residents]

    def _host_table(self, request_id: str) -> list[KVCacheBlock]:
        return self.source.req_to_blocks[request_id]

    def is_current(self, st: RequestResidency) -> bool:
        """``st`` is the live incarnation of its request (not freed, not
        replaced by a re-admission after preemption)."""
        return self.states.get(st.request_id) is st

    def is_hot_required(self, request_id: str) -> bool:
        st = self.states.get(request_id)
        return st is not None and st.hot_required

    def require_hot(self, request_id: str) -> None:
        """The request's hot region is allocated on its next scheduling pass."""
        self._set_hot_required(self._state(request_id))

    def _set_hot_required(self, st: RequestResidency) -> None:
        if not st.hot_required:
            st.hot_required = True
            st.unsettle()  # the region is allocated on the next pass

    def note_allocated(self, request_id: str) -> None:
        """The request's tables grew (pages or its hot region): its unpin
        limit and hot readiness change, so the next pass runs in full."""
        st = self.states.get(request_id)
        if st is not None:
            st.unsettle()

    def can_read_from_host(self, request_id: str) -> bool:
        """Every hot group holds the request's full region (spec 4.5)."""
        need = self.hots[0].region_blocks if self.hots else 0
        return all(
            len(m.req_to_blocks.get(request_id, ())) >= need for m in self.hots
        )

    def _hot_ready(self, st: RequestResidency) -> bool:
        if not st.hot_ready and st.hot_required:
            st.hot_ready = self.can_read_from_host(st.request_id)
        return st.hot_ready

    def has_pending_work(self) -> bool:
        """INV-15: keep the engine stepping until every ack has arrived."""
        return bool(
            self.pending_spills or self._spills_to_send or self._retired
            or self._cow_pairs or self._cow_in_flight
        )

    # --------------------------------------------------- manager callbacks

    def note_new_source_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Host blocks (re)allocated this step (hot invalidation, 4.8)."""
        self._new_source_block_ids.extend(b.block_id for b in blocks)

    def note_hot_region_allocated(
        self, request_id: str, first_block: KVCacheBlock
    ) -> None:
        """A request got a hot region (its first block in the first hot
        group): the worker assigns it a freshly reset state slot (INV-5,
        INV-24), found by the request's id (F22)."""
        self._hot_allocated[first_block.block_id] = request_id

    def note_hot_region_freed(self, first_block: KVCacheBlock) -> None:
        """A request's hot region was released (freed, finished, preempted).
        A region allocated and released before any worker heard of it (a
        request preempted in the pass that admitted its region) is dropped
        from both lists (R17)."""
        block_id = first_block.block_id
        if block_id in self._hot_allocated:
            del self._hot_allocated[block_id]
        else:
            self._hot_freed.append(block_id)

    def note_cow(self, source: KVCacheBlock, destination: KVCacheBlock) -> None:
        """A host CoW pair (4.12). The caller hands over one reference on
        each endpoint; they are released when the workers report the
        destination in ``cow_done``."""
        self._cow_pairs.append((source, destination))

    def expect_external(self, request: Request, load_async: bool = False) -> None:
        """An offloader will load this request's indexer KV beyond its local
        hit; the source manager then needs the request's block hashes. An
        asynchronous load defers the hot region to the request's first
        scheduling pass after the load (``is_loading``)."""
        st = self._state(request.request_id)
        st.request = request
        st.loading = load_async

    def no_external(self, request_id: str) -> None:
        """This scheduling attempt loads nothing (a previous one may have
        expected an asynchronous load)."""
        st = self.states.get(request_id)
        if st is not None:
            st.loading = False

    def is_loading(self, request_id: str) -> bool:
        st = self.states.get(request_id)
        return st is not None and st.loading

    def external_block_hashes(self, request_id: str, first: int, last: int) -> list:
        if self.imports.has_plan(request_id):
            # A P/D import: no page has a host copy yet. The source manager
            # takes none, and its allocation gives every imported page a
            # fresh host block (INV-6), which the importer fills (4.13).
            return []
        st = self.states.get(request_id)
        if st is None or st.request is None:
            raise RuntimeError(
                f"HiSparse: external KV for request {request_id} from a connector "
                "other than the HiSparse-aware OffloadingConnector; P/D import "
                "is not supported yet."
            )
        return list(st.request.block_hashes[first:last])

    def waits_for_publication(self, request: Request, num_computed_tokens: int) -> bool:
        """R30: may ``request``'s admission wait a step? Yes when its prefix
        hit stops at a page that a finished request is about to publish
        (its spills still landing, 4.4 step 4): admitted now it would
        compute that page again, and the prefix cache would then hold two
        computations of the same tokens (vLLM's kernels are not batch
        invariant), its groups possibly serving different ones to later
        hits. Waiting costs the step or two until the spills land; after
        MAX_PUBLICATION_WAITS attempts it computes them after all."""
        page = num_computed_tokens // self.block_size
        hashes = request.block_hashes
        waited = self._publication_waits.pop(request.request_id, 0)
        if (page >= len(hashes) or hashes[page] not in self._publishing
                or waited >= MAX_PUBLICATION_WAITS):
            return False
        self._publication_waits[request.request_id] = waited + 1
        self.stats.publication_waits += 1
        return True

    def host_prefix_tokens(self, request: Request) -> int:
        """h_s: tokens of the request's longest host prefix-cache hit."""
        gid = [self.source.kv_cache_group_id]
        n = 0
        for block_hash in request.block_hashes:
            if self.host_pool.get_cached_block(block_hash, gid) is None:
                break
            n += 1
        return n * self.block_size

    def commit_host_prefix(self, request_id: str, num_pages: int) -> None:
        """A host prefix hit of ``num_pages`` (4.7 step 2): those pages are
        valid, the resident table starts with null entries, surviving GPU
        copies are adopted after the admitting allocation, and the request
        reads from host from its first step (zero-resident regime)."""
        st = self._state(request_id)
        new_pages = num_pages - st.ready_prefix
        if new_pages <= 0:
            return
        st.valid.update(range(st.ready_prefix, num_pages))
        st.ready_prefix = num_pages
        st.next_plan = max(st.next_plan, num_pages)
        st.pages_to_adopt = num_pages
        st.copies_recorded = max(st.copies_recorded, num_pages)
        st.hot_required = True
        st.unsettle()

    def publish_when_ready(self, request: Request, num_tokens: int) -> None:
        """The source manager's ``cache_blocks``: remember the request and
        publish only what is durable (4.4, INV-18)."""
        st = self._state(request.request_id)
        st.request = request
        st.publication = num_tokens
        self._publish(st)

    # ----------------------------------------------------- per-step driver

    def advance_scheduled(self, request: Request, num_tokens: int) -> None:
        """After the request's allocation this step: plan spills of newly
        sealed pages (4.2), then residency (4.5). ``num_tokens`` is what the
        pin itself would cache: tokens computed once this step completes,
        excluding unverified draft tokens (the pin's own publish bound, so
        R_re needs no extra margin)."""
        st = self._state(request.request_id)
        st.request = request
        # The first pass of an async-loaded request runs when its load ends
        # (the pin caches its blocks then): its region comes next (R24).
        st.loading = False
        tables = self._tables(request.request_id)
        if not tables[0]:
            return
        n_full = num_tokens // self.block_size
        self._materialize(st, tables, n_full)
        self._update_residency(st, tables)
        # Settled unless a spill backlog (budget) or a hot region is due.
        backlog = st.next_plan < min(n_full, len(tables[0]))
        due = st.hot_required and not st.hot_ready
        st.settled_pages = -1 if backlog or due else n_full

    def is_settled(self, request_id: str, num_tokens: int) -> bool:
        """Nothing the full pass depends on changed since the last one."""
        st = self.states.get(request_id)
        return st is not None and st.settled_pages == num_tokens // self.block_size

    def _materialize(
        self, st: RequestResidency, tables: list[list[KVCacheBlock]], n_sealed: int
    ) -> None:
        budget = self.spill_budget - len(self._spills_to_send)
        host = self._host_table(st.request_id)
        p = max(st.next_plan, st.ready_prefix)
        n_sealed = min(n_sealed, len(tables[0]), len(host))
        while p < n_sealed and budget > 0:
            if p not in st.pending and p not in st.valid:
                blocks = tuple(t[p] for t in tables)
                if host[p].is_null or any(b.is_null for b in blocks):
                    # Only host-only pages lack a resident block; they are
                    # valid already. Never plan a spill without both ends.
                    break
                self._plan_transfer(st, p, host[p], blocks, restore=False)
                budget -= 1
            p += 1
        st.next_plan = p

    def _plan_transfer(
        self,
        st: RequestResidency,
        page: int,
        host_block: KVCacheBlock,
        resident_blocks: tuple[KVCacheBlock, ...],
        restore: bool,
    ) -> None:
        # The transfer's own leases keep both ends allocated until it
        # completes on every worker that enqueued it (INV-17).
        self.host_pool.touch([host_block])
        self.gpu_pool.touch(list(resident_blocks))
        tid = self._next_transfer_id
        self._next_transfer_id += 1
        st.pending[page] = tid
        spill = Spill(tid, st, page, host_block, resident_blocks, restore=restore)
        self.pending_spills[tid] = spill
        self._spills_to_send.append(spill)
        self.stats.spills_planned += 1

    def plan_restore(self, st: RequestResidency, page: int) -> None:
        """Plan a host -> resident copy of ``page`` (a host-landed import's
        P_last, 4.13 step 4); ``start_step`` runs it before the request's
        first forward."""
        blocks = tuple(t[page] for t in self._tables(st.request_id))
        host = self._host_table(st.request_id)[page]
        self._plan_transfer(st, page, host, blocks, restore=True)

    def _update_residency(
        self, st: RequestResidency, tables: list[list[KVCacheBlock]]
    ) -> None:
        if st.pages_to_adopt:
            self._adopt(st, tables)
        if self._hot_ready(st):
            self._unpin_eligible(st, tables)
            return
        if st.hot_required:
            return  # the region comes on a later pass; pages stay pinned
        # The free-block watermark is checked once per step, for all
        # requests (build_step_metadata); the window here, as tables grow.
        if len(tables[0]) >= self.cap_res_pages:
            self._set_hot_required(st)

    def _check_watermark(self) -> None:
        """Spec 4.5: below the watermark every running request turns
        hot-required (its region comes on its next pass), unless its region
        would cost more blocks than its pages beyond the protected tail can
        ever free (R27: a short request turned hybrid only adds pressure).
        Once per step."""
        if self.gpu_pool.get_num_free_blocks() >= self.transition_watermark:
            return
        groups = len(self.residents)
        for st in self.states.values():
            if st.hot_required or not groups:
                continue
            table = self.residents[0].req_to_blocks.get(st.request_id, ())
            if (len(table) - ACTIVE_TAIL_PAGES) * groups > self.hot_blocks_per_request:
                self._set_hot_required(st)

    # ---------------------------------------- making room (F20, R25, R26)

    def reclaimable_pages(self, request_id: str, num_tokens: int) -> list[int]:
        """Clean pinned pages that the request's own allocation for
        ``num_tokens`` may unpin (R25): valid, idle, below the protected tail
        of the grown table (INV-20) and held by the request alone, so that
        unpinning frees their blocks. Empty unless the request can get a hot
        region in this allocation (it runs a forward: not loading)."""
        st = self.states.get(request_id)
        if st is None or not st.pinned_clean or st.loading or not self.hots:
            return []
        tables = self._tables(request_id)
        limit = max(len(tables[0]), cdiv(num_tokens, self.block_size)) - ACTIVE_TAIL_PAGES
        return [
            p for p in st.pinned_clean
            if p < limit and p not in st.pending
            and all(t[p].ref_cnt == 1 for t in tables)
        ]

    def missing_region_blocks(self, request_id: str) -> int:
        """GPU blocks the request's hot region still needs that its current
        allocation cost does not count (0 once it is hot-required)."""
        st = self.states.get(request_id)
        if st is None or st.hot_required or not self.hots:
            return 0
        held = len(self.hots[0].req_to_blocks.get(request_id, ()))
        return max(self.hots[0].region_blocks - held, 0) * len(self.hots)

    def give_up_pages(self, request_id: str, pages: list[int]) -> None:
        """R25: the request turns hybrid inside its own allocation. It
        becomes hot-required, so the same allocation adds its hot region,
        and unpins ``pages`` (tail-first) so the allocation can reuse their
        blocks. INV-21 holds once the allocation returns (region and unpin
        land in one scheduling pass, hence in one step's metadata); INV-22
        holds as for any unpin: a reused block's new writer runs in a
        forward stream-ordered after every forward that read it."""
        st = self.states[request_id]
        self._set_hot_required(st)
        self._unpin_pages(st, self._tables(request_id), pages)
        self.stats.pages_unpinned_to_allocate += len(pages)

    def staged_pages_bound(
        self, request_id: str, computed_tokens: int, end_tokens: int,
        host_hit: Sequence[KVCacheBlock], popped: int,
    ) -> int:
        """Context pages the worker may stage from host for a chunk ending
        at ``end_tokens`` (R28): null and unpinned entries of the table (an
        allocation later in this pass may reuse an unpinned block), or, for
        a request that holds no table yet, its computed prefix (a host or
        offloaded hit starts with null resident entries) less the pages of
        ``host_hit`` it adopts (R33). O(pages), for short prefill chunks
        only."""
        table = self.residents[0].req_to_blocks.get(request_id) if self.residents else None
        if not table:
            pages = computed_tokens // self.block_size
            return pages - self._surely_adopted(host_hit[:pages], popped)
        n = min(len(table), cdiv(end_tokens, self.block_size))
        st = self.states.get(request_id)
        unpinned = sum(p < n for p in st.unpinned) if st is not None else 0
        return sum(b.is_null for b in table[:n]) + unpinned

    def _surely_adopted(self, host_blocks: Sequence[KVCacheBlock], popped: int) -> int:
        """Pages of an admission's host prefix that its adoption (4.7 step 3,
        right after the admitting allocation) will find a GPU copy for: a
        copy survives unless one of its blocks is among the ``popped`` free
        blocks the allocation itself takes (R33). O(pages + popped)."""
        if not host_blocks or not self.copies:
            return 0
        at_risk = self.gpu_pool.next_free_block_ids(popped)
        adopted = 0
        for host in host_blocks:
            blocks = self.copies.get(host.block_hash)
            if blocks is not None and all(b.block_id not in at_risk for b in blocks):
                adopted += 1
        return adopted

    def blocks_released_by_in_flight(self, request_id: str, num_tokens: int) -> int:
        """GPU blocks that become free, or reclaimable by ``request_id``'s
        next allocation (R25), once the transfers in flight complete (R26).
        A spill's completion releases its lease; the page is then unpinned
        if its request reads from host and the page is below its tail. Only
        called when an allocation fails: O(pending transfers)."""
        released = 0
        for spill in self.pending_spills.values():
            if spill.restore:
                continue
            st, blocks = spill.state, spill.resident_blocks
            if not self.is_current(st):
                # A freed incarnation: the lease is the last reference.
                released += sum(b.ref_cnt == 1 for b in blocks)
                continue
            length = len(self._tables(st.request_id)[0])
            if st.request_id == request_id:
                length = max(length, cdiv(num_tokens, self.block_size))
            elif not self._hot_ready(st):
                continue  # it stays pinned: no hot region to read it from
            if spill.page < length - ACTIVE_TAIL_PAGES and all(
                b.ref_cnt == 2 for b in blocks  # the request and the lease
            ):
                released += len(blocks)
        return released

    # ------------------------------------------------- unpin / reuse / lose

    def _unpin_eligible(
        self, st: RequestResidency, tables: list[list[KVCacheBlock]]
    ) -> None:
        """Unpin every clean pinned page allowed by INV-20, tail-first."""
        if not st.pinned_clean:
            return
        limit = len(tables[0]) - ACTIVE_TAIL_PAGES
        pages = [p for p in st.pinned_clean if p < limit and p not in st.pending]
        self._unpin_pages(st, tables, pages)

    def _unpin_pages(
        self, st: RequestResidency, tables: list[list[KVCacheBlock]], pages: list[int]
    ) -> None:
        """Unpin ``pages`` (clean, pinned, idle) tail-first in one pool call."""
        if not pages:
            return
        pages = sorted(pages, reverse=True)
        blocks: list[KVCacheBlock] = []
        owners = self.owners
        for p in pages:
            key = (st, p)
            for t in tables:
                blk = t[p]
                mine = owners.get(blk.block_id)
                if mine is None:
                    owners[blk.block_id] = {key}
                else:
                    mine.add(key)
                blocks.append(blk)
        st.pinned_clean.difference_update(pages)
        st.unpinned.update(pages)
        self.gpu_pool.unpin_blocks(blocks, self._on_block_reused)
        self.stats.pages_unpinned += len(pages)

    def _on_block_reused(self, block: KVCacheBlock) -> None:
        """The pool handed an unpinned block to someone else (4.6 step 2):
        its copies entry and the pages reading it are lost. A step still in
        flight may read its old bytes: the new owner writes in a forward
        stream-ordered after it, and the offloader's loads wait for the
        compute stream (F16, docs/worker.md K10)."""
        self._drop_copy(block.block_id)
        for st, page in self.owners.pop(block.block_id, ()):
            self._lose_page(st, page, block.block_id)

    def _lose_page(self, st: RequestResidency, page: int, reused_id: int) -> None:
        """Null the page in every resident group (INV-7, INV-22)."""
        for m in self.residents:
            blk = m.drop_page(st.request_id, page)
            if blk.block_id != reused_id:
                self._disown(blk, st, page)
        st.unpinned.discard(page)
        self._mark_dirty(st, page)
        self._set_hot_required(st)
        self.stats.lost_pages += 1

    def _disown(self, blk: KVCacheBlock, st: RequestResidency, page: int) -> None:
        owners = self.owners.get(blk.block_id)
        if owners is not None:
            owners.discard((st, page))
            if not owners:
                del self.owners[blk.block_id]

    def _mark_dirty(self, st: RequestResidency, page: int) -> None:
        """The worker's copy of ``st``'s resident table differs from ``page``."""
        if page < st.dirty_from:
            st.dirty_from = page
            self._dirty[st] = None

    # --------------------------------------------------- copies / adoption

    def _record_copies(self, st: RequestResidency, upto: int) -> None:
        """Index GPU copies of newly published pages (4.7 step 1)."""
        if upto <= st.copies_recorded:
            return
        host = self._host_table(st.request_id)
        tables = self._tables(st.request_id)
        for p in range(st.copies_recorded, upto):
            if p in st.pending or p >= len(tables[0]):
                continue
            blocks = tuple(t[p] for t in tables)
            key = host[p].block_hash
            if key is None or any(b.is_null for b in blocks):
                continue
            old = self.copies.get(key)
            if old is not None:
                for b in old:
                    self._copy_of_block.pop(b.block_id, None)
            self.copies[key] = blocks
            for b in blocks:
                previous = self._copy_of_block.get(b.block_id)
                if previous is not None and previous != key:
                    self.copies.pop(previous, None)
                self._copy_of_block[b.block_id] = key
        st.copies_recorded = upto

    def _drop_copy(self, block_id: int) -> None:
        key = self._copy_of_block.pop(block_id, None)
        if key is None:
            return
        for b in self.copies.pop(key, ()):
            self._copy_of_block.pop(b.block_id, None)

    def clear_copies(self) -> None:
        """The prefix cache was reset: no published host block remains."""
        self.copies.clear()
        self._copy_of_block.clear()

    def _adopt(self, st: RequestResidency, tables: list[list[KVCacheBlock]]) -> None:
        """Adopt surviving GPU copies of host-prefix pages (4.7 step 3),
        only into null entries (INV-23) and only after the admitting
        allocation (which counted those blocks as free)."""
        host, first, copies = self._host_table(st.request_id), tables[0], self.copies
        pages: list[int] = []
        found: list[tuple[KVCacheBlock, ...]] = []
        for p in range(min(st.pages_to_adopt, len(first))):
            if not first[p].is_null:
                continue
            blocks = copies.get(host[p].block_hash)
            if blocks is not None:
                pages.append(p)
                found.append(blocks)
        st.pages_to_adopt = 0
        if not pages:
            return
        # One touch and one table write per group for the whole hit: a long
        # prefix is thousands of pages (P2: admission cost).
        self.gpu_pool.touch([b for blocks in found for b in blocks])
        for i, m in enumerate(self.residents):
            m.adopt_pages(st.request_id, pages, [blocks[i] for blocks in found])
        st.pinned_clean.update(pages)
        self._mark_dirty(st, pages[0])
        self.stats.pages_adopted += len(pages)

    # -------------------------------------------------------- publication

    def _publish(self, st: RequestResidency) -> None:
        """Publish min(requested, durable prefix) tokens (4.4 step 2)."""
        if st.publication is None or st.request is None or not self.is_current(st):
            return
        num_pages = min(st.publication // self.block_size, st.ready_prefix)
        if num_pages > self.source.num_cached_block.get(st.request_id, 0):
            self.source.publish_prefix(st.request, num_pages * self.block_size)
            self._record_copies(st, num_pages)
        if st.ready_prefix * self.block_size >= st.publication:
            st.publication = None

    def _publish_detached(self, st: RequestResidency) -> None:
        d = st.detached
        assert d is not None
        num_full = min(st.ready_prefix, d.num_pages)
        if num_full > d.num_cached_pages:
            self.host_pool.cache_full_blocks(
                request=d.request,
                blocks=d.host_blocks,
                num_cached_blocks=d.num_cached_pages,
                num_full_blocks=num_full,
                block_size=self.block_size,
                kv_cache_group_id=self.source.kv_cache_group_id,
            )
        self.host_pool.free_blocks(reversed(d.host_blocks))
        for block_hash in d.pending_hashes:
            left = self._publishing.pop(block_hash) - 1
            if left:
                self._publishing[block_hash] = left
        st.detached = None

    # ------------------------------------------------------------ acks

    def update_spills(self, ack: HiSparseWorkerAck) -> None:
        """Apply aggregated worker acks (4.3): CoW first, then spills.

        A spill's completion counts only if the workers submitted it after
        the forward of the step that carried it (F17, ``submitted_step``);
        an earlier submission proves nothing about the KV and is ignored.
        Completions otherwise accumulate as rank sets (R1). With a shared host
        pool only the writer's spill reports count (R23)."""
        for dst in ack.cow_done:
            pair = self._cow_in_flight.pop(dst, None)
            if pair is not None:
                self.host_pool.free_blocks(pair)
        for tid, ranks in ack.enqueued.items():
            spill = self.pending_spills.get(tid)
            if spill is not None:
                spill.enqueued |= self._reporting(spill, ranks)
        for tid, step in ack.submitted_step.items():
            spill = self.pending_spills.get(tid)
            if spill is not None:
                spill.submitted_step = step
        advanced: dict[int, RequestResidency] = {}
        for tid, ranks in ack.completed.items():
            spill = self.pending_spills.get(tid)
            if spill is None:
                continue  # retired already: a repeated or duplicated ack
            if not spill.restore and (
                spill.submitted_step is None
                or spill.submitted_step < spill.planned_step
            ):
                self.stats.completions_ignored += 1
                logger.debug(
                    "HiSparse: ignoring the completion of transfer %d: submitted "
                    "after the forward of step %s, planned for step %d (F17)",
                    tid, spill.submitted_step, spill.planned_step,
                )
                continue
            spill.completed |= self._reporting(spill, ranks)
            if spill.enqueued and spill.completed >= spill.enqueued:
                self._finish_spill(spill)
                advanced[id(spill.state)] = spill.state
        for st in advanced.values():
            if self.is_current(st):
                # One batch per request, so the unpin is tail-first.
                if self._hot_ready(st):
                    self._unpin_eligible(st, self._tables(st.request_id))
                self._publish(st)
            elif st.detached is not None and not st.pending:
                self._publish_detached(st)

    def _reporting(self, spill: Spill, ranks: frozenset[int]) -> frozenset[int]:
        """The ranks whose report counts for ``spill``: every rank for a
        restore (each fills its own resident block) or with private pools;
        only the host writer for a spill into a shared pool (INV-28)."""
        if self._spill_reporters is None or spill.restore:
            return ranks
        if not ranks <= self._spill_reporters:
            self.stats.reader_reports_ignored += 1
            logger.warning_once(
                "HiSparse: a non-writer TP rank reported a spill of the shared "
                "host pool; only TP rank 0's reports count (INV-28)."
            )
        return ranks & self._spill_reporters

    def _finish_spill(self, spill: Spill) -> None:
        del self.pending_spills[spill.transfer_id]
        self._retired.append(spill.transfer_id)
        self.stats.spills_completed += 1
        st, p = spill.state, spill.page
        st.pending.pop(p, None)
        if not spill.restore:
            st.valid.add(p)
            while st.ready_prefix in st.valid:
                st.ready_prefix += 1
        # Release the transfer's leases before any unpin, so that the unpin
        # is the last reference dropped and puts the blocks at the tail.
        self.gpu_pool.free_blocks(spill.resident_blocks)
        self.host_pool.free_blocks([spill.host_block])
        if self.is_current(st) and p in st.valid:
            st.pinned_clean.add(p)

    # ------------------------------------------------------------- free

    def free(self, request_id: str) -> None:
        """Called before the managers free the request (4.6 step 5).

        Clean pages become anonymous readable copies (unpinned, tail-first);
        pages already unpinned leave the owner sets; dirty and pending pages
        are left to the managers' normal free (a pending page's transfer
        lease keeps it alive). Spills planned in the current scheduling pass
        and not yet sent are cancelled (R15, F17). A finished request with
        spills pending detaches its host prefix for a single later
        publication; a preempted one drops its publication (INV-19).
        """
        self._publication_waits.pop(request_id, None)  # aborted while waiting
        self.imports.forget_import(request_id)
        st = self.states.pop(request_id, None)
        if st is None:
            return
        self._dirty.pop(st, None)
        finished = st.request is not None and st.request.is_finished()
        if st.pending:
            # R31: a finished request keeps its unsent spills of written pages.
            # vLLM's async scheduler caches a request's new tokens after each
            # output (AsyncScheduler._update_request_with_output), so a page
            # its last step sealed is planned there, after the last pass.
            keep = durable_tokens(st.request) // self.block_size if finished else 0
            self._cancel_unsent_spills(st, keep_below=keep)
        tables = self._tables(request_id) if self.residents else []
        if tables and tables[0]:
            for p in st.unpinned:
                for m in self.residents:
                    self._disown(m.drop_page(request_id, p), st, p)
            anonymous: list[KVCacheBlock] = []
            for p in sorted(st.pinned_clean, reverse=True):
                if p in st.pending or p >= len(tables[0]):
                    continue
                anonymous.extend(m.drop_page(request_id, p) for m in self.residents)
            if anonymous:
                self.gpu_pool.unpin_blocks(anonymous, self._on_block_reused)
            st.unpinned.clear()
            st.pinned_clean.clear()
        if finished and st.pending and st.publication is not None:
            self._detach(st)
        st.publication = None

    def _cancel_unsent_spills(self, st: RequestResidency, keep_below: int = 0) -> None:
        """Drop the spills no worker has seen (R15). They were planned in
        this scheduling pass for pages its forward would have sealed; the
        request left the pass (preempted while scheduling a later request),
        so that forward never writes them (F17). Their leases go back now.
        Pages below ``keep_below`` were written already (R31) and stay."""
        cancelled: set[int] = set()
        for page, tid in list(st.pending.items()):
            spill = self.pending_spills[tid]
            if spill.planned_step or page < keep_below:
                continue  # sent: the workers will complete it (leases until then)
            del self.pending_spills[tid]
            del st.pending[page]
            self.gpu_pool.free_blocks(spill.resident_blocks)
            self.host_pool.free_blocks([spill.host_block])
            cancelled.add(tid)
        if cancelled:
            self._spills_to_send = [
                s for s in self._spills_to_send if s.transfer_id not in cancelled
            ]
            self.stats.spills_cancelled += len(cancelled)

    def _detach(self, st: RequestResidency) -> None:
        assert st.request is not None and st.publication is not None
        host = self._host_table(st.request_id)
        num_pages = min(st.publication // self.block_size, len(host))
        blocks = list(host[:num_pages])
        self.host_pool.touch(blocks)
        cached = self.source.num_cached_block.get(st.request_id, 0)
        pending = tuple(st.request.block_hashes[cached:num_pages])
        for block_hash in pending:
            self._publishing[block_hash] = self._publishing.get(block_hash, 0) + 1
        st.detached = DetachedPublication(
            request=st.request,
            host_blocks=blocks,
            num_pages=num_pages,
            num_cached_pages=cached,
            pending_hashes=pending,
        )

    # --------------------------------------------------------- metadata

    def build_step_metadata(
        self, scheduler_output: "SchedulerOutput"
    ) -> HiSparseStepMetadata:
        """Drain this step's outputs (spec 4.1 step 3) into flat arrays.

        No row-mirror envelopes: the workers mirror exactly the rows each
        forward wrote (docs/residency.md R16, docs/worker.md K2)."""
        self.step += 1
        self._check_watermark()
        g = len(self.residents)
        meta = HiSparseStepMetadata(step=self.step)
        meta.transfer_resident_blocks = meta.update_block_ids = empty_ids(np.int32, g)
        if self._dirty:
            self._residency_updates(meta, scheduler_output, g)
        spills = self._spills_to_send
        if spills:
            self._spills_to_send = []
            for spill in spills:
                spill.planned_step = self.step
            meta.transfer_ids = np.array(
                [s.transfer_id for s in spills], dtype=np.int64
            )
            meta.transfer_host_blocks = np.array(
                [s.host_block.block_id for s in spills], dtype=np.int32
            )
            meta.transfer_resident_blocks = np.array(
                [[b.block_id for b in s.resident_blocks] for s in spills],
                dtype=np.int32,
            ).reshape(len(spills), g)
            meta.transfer_restore = np.array(
                [s.restore for s in spills], dtype=np.bool_
            )
        if self._cow_pairs:
            pairs, self._cow_pairs = self._cow_pairs, []
            meta.cow_src = np.array([s.block_id for s, _ in pairs], dtype=np.int32)
            meta.cow_dst = np.array([d.block_id for _, d in pairs], dtype=np.int32)
            for src, dst in pairs:
                self._cow_in_flight[dst.block_id] = (src, dst)
        if self._new_source_block_ids:
            meta.new_source_block_ids = np.array(
                self._new_source_block_ids, dtype=np.int32
            )
            self._new_source_block_ids = []
        if self._hot_freed:
            meta.hot_regions_freed = np.array(self._hot_freed, dtype=np.int32)
            self._hot_freed = []
        if self._hot_allocated:
            meta.hot_regions_allocated = np.fromiter(
                self._hot_allocated, dtype=np.int32, count=len(self._hot_allocated)
            )
            meta.hot_region_requests = list(self._hot_allocated.values())
            self._hot_allocated = {}
        if self._retired:
            meta.retired_transfer_ids = np.array(self._retired, dtype=np.int64)
            self._retired = []
        return meta

    def _residency_updates(
        self, meta: HiSparseStepMetadata, so: "SchedulerOutput", g: int
    ) -> None:
        """Residency updates (4.6 step 4) of the dirty requests scheduled
        this step, as CSR rows [start page, end of table) x G. New and
        resumed requests receive their whole table through vLLM's own block
        ids, so they need none; unscheduled ones stay dirty."""
        scheduled = so.num_scheduled_tokens
        full_table: set[str] | None = None
        req_ids: list[str] = []
        starts: list[int] = []
        rows: list[np.ndarray] = []
        # In request-id order: the order the tables changed in depends on
        # when each pass ran (event-driven or in full), the content does not.
        for st in sorted(self._dirty, key=_request_id):
            req_id = st.request_id
            if req_id not in scheduled:
                continue
            del self._dirty[st]
            start, st.dirty_from = st.dirty_from, _CLEAN
            if full_table is None:
                full_table = {r.req_id for r in so.scheduled_new_reqs}
                full_table |= so.scheduled_cached_reqs.resumed_req_ids
            if req_id in full_table:
                continue
            req_ids.append(req_id)
            starts.append(start)
            rows.append(np.array(
                [[b.block_id for b in t[start:]] for t in self._tables(req_id)],
                dtype=np.int32,
            ).reshape(g, -1).T)
        if not req_ids:
            return
        meta.update_req_ids = req_ids
        meta.update_start_pages = np.array(starts, dtype=np.int32)
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=indptr[1:])
        meta.update_indptr = indptr
        meta.update_block_ids = np.ascontiguousarray(np.concatenate(rows))
