# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""P/D imports, scheduler side (spec 4.13, INV-30; docs/pd-imports.md).

Imported KV lands in resident GPU pages when it fits, else in the host pool;
an import that is not admissible waits (never a preemption) or, after
MAX_IMPORT_WAITS attempts, is recomputed. ``ImportTracker`` owns the
per-request import lifecycle (landing choice, waits, begin, completion,
failure); the residency coordinator owns it (``HiSparseCoordinator.imports``)
and keeps the residency state it acts on: each request's
``RequestResidency.importing``, the pools, the resident managers and the
counters. The connector half that calls it is
``kv_connector/v1/hisparse/importing.py``.
"""

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.hisparse.constants import MAX_IMPORT_WAITS
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator


class ImportLanding(enum.Enum):
    """Where a P/D import's pages land (spec 4.13 step 1), or RECOMPUTE: the
    import was given up and the request computes its prompt itself."""

    DEVICE = "device"
    HOST = "host"
    RECOMPUTE = "recompute"


@dataclass(eq=False)
class ImportPlan:
    """A P/D import of pages [first_page, end_page) and its landing, chosen
    once at admission and kept across the scheduler's retries (4.13)."""

    landing: ImportLanding
    first_page: int
    end_page: int

    @property
    def pages(self) -> range:
        return range(self.first_page, self.end_page)

    @property
    def landed_pages(self) -> range:
        """Pages that get a resident block at admission: every page on the
        device, only the last one (P_last, restored later) on the host."""
        if self.landing is ImportLanding.DEVICE:
            return self.pages
        return range(self.end_page - 1, self.end_page)


class ImportTracker:
    """The P/D imports of one scheduler's residency coordinator (4.13)."""

    def __init__(self, residency: "HiSparseCoordinator") -> None:
        self._residency = residency
        # Request id -> the landing chosen at its first admissible attempt
        # (until admitted), attempts waited so far, and requests whose
        # import was given up (they ask for 0 tokens).
        self._plans: dict[str, ImportPlan] = {}
        self._waits: dict[str, int] = {}
        self._given_up: set[str] = set()
        self.gpu_blocks_per_page = 1
        """GPU blocks a page costs outside the resident and hot groups (the
        indexer and any other group); the importing connector sets it."""

    def has_plan(self, request_id: str) -> bool:
        """A landing is chosen and the scheduler is allocating the import."""
        return request_id in self._plans

    def import_landing(
        self, request: Request, first_token: int, end_token: int
    ) -> ImportLanding | None:
        """Where an import of tokens [first_token, end_token) lands (4.13
        step 1); None: not admissible now, the request waits a step.

        The landing is chosen at the first attempt where one fits and kept
        on every retry (a retry re-checks only that it still fits). DEVICE
        when the whole imported context fits in resident pages with the
        transition watermark left free (so a landing never itself turns the
        running requests hot); HOST when its host blocks and the fixed GPU
        footprint fit. Neither: wait; after MAX_IMPORT_WAITS attempts the
        import is given up (RECOMPUTE, for good). Never preempts (INV-30).
        Both tokens are block-aligned."""
        req_id = request.request_id
        if req_id in self._given_up:
            return ImportLanding.RECOMPUTE
        res = self._residency
        b = res.block_size
        plan = self._plans.get(req_id)
        first, end = first_token // b, end_token // b
        if plan is None:
            plan = self._choose_landing(request, first, end)
        else:  # the host prefix may have grown while it waited
            plan.first_page, plan.end_page = first, end
            if not self._landing_fits(request, plan):
                plan = None
        if plan is not None:
            self._plans[req_id] = plan
            # It loads asynchronously: no hot region until the load ends (R24).
            res.expect_external(request, load_async=True)
            return plan.landing
        res.no_external(req_id)
        waited = self._waits.get(req_id, 0)
        if waited >= MAX_IMPORT_WAITS:
            self.give_up_import(req_id)
            return ImportLanding.RECOMPUTE
        self._waits[req_id] = waited + 1
        res.stats.import_waits += 1
        return None

    def _choose_landing(
        self, request: Request, first: int, end: int
    ) -> ImportPlan | None:
        for landing in (ImportLanding.DEVICE, ImportLanding.HOST):
            plan = ImportPlan(landing, first, end)
            if self._landing_fits(request, plan):
                return plan
        return None

    def _landing_fits(self, request: Request, plan: ImportPlan) -> bool:
        """The admission computation of 4.15 for an imported prompt: host
        blocks for every page from the import on plus the tail block; GPU
        blocks for the indexer (and other groups) of those pages, the hot
        region (a request with history starts zero-resident) and the
        resident pages: the imported ones (DEVICE) or only P_last (HOST),
        plus the pages still to compute."""
        res = self._residency
        pages = cdiv(request.num_tokens, res.block_size) - plan.first_page
        new_pages = pages - len(plan.pages)
        if res.host_pool.get_num_free_blocks() < pages + 1:
            return False
        resident = (len(plan.landed_pages) + new_pages) * len(res.residents)
        gpu = pages * self.gpu_blocks_per_page + res.hot_blocks_per_request
        free = res.gpu_pool.get_num_free_blocks()
        if plan.landing is ImportLanding.DEVICE:
            free -= res.transition_watermark
        return gpu + resident <= free

    def give_up_import(self, request_id: str) -> None:
        """The request computes its prompt itself from now on."""
        self._plans.pop(request_id, None)
        self._waits.pop(request_id, None)
        self._given_up.add(request_id)
        self._residency.stats.import_fallbacks += 1

    def forget_import(self, request_id: str) -> None:
        """The attempt imports nothing (or the request left): drop its
        choice and wait count (a preempted request chooses afresh)."""
        self._plans.pop(request_id, None)
        self._waits.pop(request_id, None)
        self._given_up.discard(request_id)

    def begin_import(self, request: Request) -> ImportPlan:
        """The scheduler allocated the import's blocks (4.13 steps 1-2).

        The managers gave every imported page a fresh host block (source)
        and indexer block, and a null resident entry (a host-only page).
        The landed pages now get resident blocks: the admission check of
        ``import_landing`` counted them. The pages are marked importing; the
        request runs no forward until the load completes (it loads
        asynchronously, like an offloaded hit: no hot region yet, R24)."""
        req_id = request.request_id
        plan = self._plans.pop(req_id)
        self._waits.pop(req_id, None)
        res = self._residency
        res.expect_external(request, load_async=True)
        st = res.states[req_id]
        self._adopt_fresh_blocks(req_id, plan.landed_pages)
        if plan.landing is ImportLanding.DEVICE and plan.first_page == 0:
            # Every page of its context is resident: not zero-resident,
            # so it is not hot-required merely for having history (1.3).
            st.hot_required = False
        # Pages [first, end) are importing: not valid, never read, until
        # ``complete_import`` (INV-30).
        st.importing = plan
        st.unsettle()
        return plan

    def complete_import(self, request_id: str) -> None:
        """The load finished (4.13 step 3): every imported page is valid
        (the importer wrote its host rows in both landings; the request's
        first forward comes later). Device-landed pages are clean and
        pinned; a host landing plans exactly one restore, of P_last, even
        when full (INV-20: both tail pages resident from the first decode
        step). Called once per import, before the request is scheduled."""
        res = self._residency
        st = res.states.get(request_id)
        plan = st.importing if st is not None else None
        if plan is None:
            return
        st.importing = None
        st.valid.update(plan.pages)
        while st.ready_prefix in st.valid:
            st.ready_prefix += 1
        st.next_plan = max(st.next_plan, plan.end_page)
        n = len(plan.pages)
        if plan.landing is ImportLanding.DEVICE:
            st.pinned_clean.update(plan.pages)
            res.stats.import_device_pages += n
        else:
            res.plan_restore(st, plan.end_page - 1)
            res.stats.import_host_pages += n
        st.unsettle()

    def fail_import(self, request_id: str) -> int:
        """The load failed (4.13 step 5): the importing marks drop, no page
        becomes valid, and the request computes the pages itself. A host
        landing's null entries get resident blocks for that computation (the
        forward writes resident pages); returns the tokens to rewind to."""
        res = self._residency
        st = res.states.get(request_id)
        plan = st.importing if st is not None else None
        if plan is None:
            return 0
        st.importing = None
        missing = [
            p for p in plan.pages
            if res.residents
            and res.residents[0].req_to_blocks[request_id][p].is_null
        ]
        g = len(res.residents)
        if len(missing) * g > res.gpu_pool.get_num_free_blocks():
            raise RuntimeError(
                f"HiSparse: the P/D import of {request_id} failed and the GPU "
                f"pool cannot back its recomputation ({len(missing) * g} blocks "
                "for its host-landed pages); see docs/pd-imports.md."
            )
        self._adopt_fresh_blocks(request_id, missing)
        self._given_up.add(request_id)  # a retry asks for 0 tokens
        res.stats.import_fallbacks += 1
        st.unsettle()
        return plan.first_page * res.block_size

    def _adopt_fresh_blocks(self, request_id: str, pages: Sequence[int]) -> None:
        """A fresh block for each of ``pages`` in every resident group."""
        res = self._residency
        g = len(res.residents)
        blocks = res.gpu_pool.get_new_blocks(len(pages) * g)
        for i, page in enumerate(pages):
            for j, m in enumerate(res.residents):
                m.adopt_page(request_id, page, blocks[i * g + j])
