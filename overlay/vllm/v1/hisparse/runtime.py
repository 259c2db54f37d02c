# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C7: the HiSparse hot-path runtime of one worker (spec 2.8, 4.8, 5.0).

It owns the GPU state the decode path reads and writes:

- per index group (a leader and its IndexShare followers): ``dgi`` (int32
  [S + 1, H], the host row cached in each hot slot, -1 = empty), ``lru``
  (int16 [S + 1, H], a permutation, position 0 = least recently used; row S
  is the shared state of requests without a hot region) and ``stats``
  (uint64 [4]: hits, misses, tripped misses, rejected rows);
- request-state slots: a slot is given to every hot region the scheduler
  allocates (named by the region's first block in the first hot group, and
  by its request), reset on assignment (INV-24) and kept per request, state
  the worker owns: ``req_state[row]`` is the slot of the row's request, or
  the shared resident-only row S for a request without a region, never read
  from block-table contents the worker did not write (F22: vLLM leaves stale
  ids in rows it condenses away or adds without hot blocks);
- the per-step inputs of the kernels, written outside any CUDA graph into
  persistent tensors (INV-32): ``req_state`` (int32 [S]) and ``row_req``
  (int32 [max_tokens]: the batch row of each token, -1 = padding, F13);
- one resolver workspace shared by every index group of the model (INV-9):
  out_rows, valid_counts, plan_src, plan_dst, plan_count. A group's resolve
  overwrites it only after every layer reading the previous group's contents
  has been enqueued on the same stream.

NOTE (a decision, docs/worker.md K6): the leader's resolver and gather run
on the compute stream, in its attention call (its own attention waits for
them). Followers replay the leader's plan with their own views, on the
compute stream too, or, with ``prefetch_followers``, on a copy stream right
after the leader's gather (``FollowerPrefetch``: spec 2.10's overlap); INV-9
holds by stream order and the followers' joins.

The runtime never decides residency (INV-8): it applies what the scheduler
sent and what the block tables say.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.hisparse.config_checks import order_mode
from vllm.v1.hisparse.staging import (
    StagedRequest,
    context_pages,
    host_backed_rows,
    page_copy_rows,
    plan_staged_request,
    require_host_blocks,
    to_device,
)

logger = init_logger(__name__)


class BatchState(Protocol):
    """What the runtime reads of the runner's persistent batch: per-group
    block tables and slot mappings, and the batch's real (unpadded) sizes."""

    def num_reqs(self) -> int:
        """Requests in this step's batch (rows 0..num_reqs-1)."""
        ...

    def num_tokens(self) -> int:
        """Tokens in this step's batch, without CUDA-graph padding."""
        ...

    def seq_lens_cpu(self) -> np.ndarray:
        """int [num_reqs]: context length of each request once this step's
        tokens are computed (exact for prefill rows)."""
        ...

    def query_start_loc(self) -> np.ndarray:
        """int32 [num_reqs + 1]: each row's first token (the runner's host
        buffer; read before it is rewritten for the next step)."""
        ...

    def req_rows(self) -> Mapping[str, int]:
        """Request id -> its row in this step's batch."""
        ...

    def token_rows(self) -> np.ndarray:
        """int [num_tokens]: the batch row of each of this step's tokens
        (what the attention metadata's ``req_id_per_token`` holds for the
        real tokens), from the runner's CPU query start locations."""
        ...

    def device(self, group_id: int) -> torch.Tensor:
        """int32 [max_reqs, max_blocks]: the committed device table."""
        ...

    def host(self, group_id: int) -> np.ndarray:
        """int32 [max_reqs, max_blocks]: the CPU table of the same rows."""
        ...

    def slot_mapping(self, group_id: int) -> torch.Tensor:
        """int64 [max_tokens]: this step's slot of each token (-1 = padding)."""
        ...


class KernelOps(Protocol):
    """The HiSparse ops (``vllm.v1.hisparse.kernels`` on CUDA; the CPU
    references of ``vllm.v1.hisparse.reference`` in CPU tests)."""

    resolve_residency: Callable[..., None]
    gather_compact: Callable[..., None]
    order_plan: Callable[..., None]
    order_step: Callable[..., None]
    gather_ordered: Callable[..., None]
    order_step_temp_bytes: Callable[..., int]
    gather_plan: Callable[..., None]
    invalidate_written_slots: Callable[..., None]
    copy_descriptors: Callable[..., None]
    mirror_descriptors: Callable[..., None]


@dataclass
class LayerViews:
    """One sparse-MLA layer's views (spec 2.9, INV-10, INV-13)."""

    name: str
    pair: int
    """Index of its resident/hot group pair."""
    offset: int
    """off_l: byte offset of the layer inside a block of its pair."""
    resident: torch.Tensor
    """uint8 [N_gpu, B, W] strided view of the slab at off_l: the KV write
    target, the hot view (the same object, INV-13) and the source of
    device-to-device staging."""
    attention: torch.Tensor
    """uint8 [X, B, W] view that FlashMLA reads by attention row id
    (flat mode: contiguous from off_l, Sa = bytes_per_block / W)."""
    host: torch.Tensor
    """uint8 [N_host * B, W]: host row g at row g (pinned, device-mapped)."""
    host_ptr: int
    group: "IndexGroup"
    is_draft: bool = False
    """A drafter (MTP) layer: its rows come from each draft pass's metadata
    and it is mirrored after the drafter (docs/mtp.md 3.3, 3.5)."""


@dataclass
class HotState:
    """Every index group's hot-buffer state in one allocation: ``dgi``
    int32 and ``lru`` int16 [G, S + 1, H]. Group i reads and writes the
    contiguous views [i] (K1 takes one group's); a slot's reset and K4's
    invalidation take all groups at once: a launch each per step, not one
    per group (P2: DeepSeek-V3.2 has an indexer in each of its 61 layers)."""

    dgi: torch.Tensor
    lru: torch.Tensor


@dataclass
class IndexGroup:
    """A leader and its IndexShare followers (spec 2.10, INV-11)."""

    index: int
    leader: str
    layers: tuple[str, ...]
    pair: int
    dgi: torch.Tensor
    """hot.dgi[index]"""
    lru: torch.Tensor
    """hot.lru[index]"""
    stats: torch.Tensor
    hot: HotState


@dataclass
class ExtendPlan:
    """Rows of a step's decode-path extends (K13)."""

    effective: tuple[torch.Tensor, ...]
    """Per resident group: int32 [n, width] block of each page, null pages
    replaced by their staging block."""
    width: int
    host_src_rows: torch.Tensor
    dst_rows: torch.Tensor
    mask: torch.Tensor


@dataclass
class Workspace:
    """The resolver outputs shared by every index group (INV-9)."""

    out_rows: torch.Tensor
    valid_counts: torch.Tensor
    plan_src: torch.Tensor
    plan_dst: torch.Tensor
    plan_count: torch.Tensor
    owner: "IndexGroup | None" = None
    """The group whose plan the workspace holds (Python state: a follower
    reached without its leader's plan is a bug, spec 2.10 step 4)."""
    step_order: "StepOrder | None" = None
    """K7's buffers when ``order_misses`` is "step", else None."""

    @classmethod
    def allocate(cls, rows: int, top_k: int, device: torch.device) -> "Workspace":
        def make(*shape: int) -> torch.Tensor:
            return torch.full(shape, -1, dtype=torch.int32, device=device)

        return cls(
            out_rows=make(rows, top_k),
            valid_counts=torch.zeros(rows, dtype=torch.int32, device=device),
            plan_src=make(rows, top_k),
            plan_dst=make(rows, top_k),
            plan_count=torch.zeros(rows, dtype=torch.int32, device=device),
        )


@dataclass
class StepOrder:
    """K7's buffers (docs/kernels.md P9): the step's plan cells as one list
    sorted by host row. Sized once for the workspace's R_ws x K cells, the
    CUB scratch asked for then, so a step allocates nothing (INV-32)."""

    keys: torch.Tensor
    cells: torch.Tensor
    sorted_keys: torch.Tensor
    sorted_cells: torch.Tensor
    """int32 [R_ws * K]; a step of nd rows uses the first nd * K."""
    total: torch.Tensor
    """int32 [1]: the step's live cells (written by K7 on the device)."""
    temp: torch.Tensor
    """uint8: the radix sort's temporary storage."""

    @classmethod
    def allocate(cls, cells: int, temp_bytes: int, device: torch.device) -> "StepOrder":
        def make() -> torch.Tensor:
            return torch.full((cells,), -1, dtype=torch.int32, device=device)

        return cls(
            keys=make(),
            cells=make(),
            sorted_keys=make(),
            sorted_cells=make(),
            total=torch.zeros(1, dtype=torch.int32, device=device),
            temp=torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=device),
        )

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """keys, cells, sorted_keys, sorted_cells of an n-cell step."""
        return self.keys[:n], self.cells[:n], self.sorted_keys[:n], self.sorted_cells[:n]


class StepInputs:
    """The per-step kernel inputs ``row_req`` (int32 [max_tokens]) and
    ``req_state`` (int32 [max_num_seqs]) as views of one device tensor,
    written from a pinned host buffer in one asynchronous copy per step
    (P2: one copy instead of two fills and two copies, and never from
    pageable memory, which the driver may stage synchronously).

    The host buffers alternate; before one is rewritten, the copy that read
    it two steps ago is waited for (a deliberate host sync on an event that
    has long completed: the compute stream runs at most one step behind).
    A step whose inputs equal what the device tensor already holds (a
    steady decode batch) copies nothing; a run outside a step resets the
    tensor to padding first (``reset``, F13)."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.cuda = device.type == "cuda"
        self.tensor = torch.full(
            (max_tokens + max_seqs,), -1, dtype=torch.int32, device=device
        )
        self.row_req = self.tensor[:max_tokens]
        self.req_state = self.tensor[max_tokens:]
        # On a CPU device (tests) the tensor itself is the host buffer.
        self._host = [
            torch.full(self.tensor.shape, -1, dtype=torch.int32, pin_memory=True)
            for _ in range(2)
        ] if self.cuda else [self.tensor]
        # Their numpy views, made once (P2: no view objects per step).
        self._host_np = [
            (h[:max_tokens], h[max_tokens:], h)
            for h in (t.numpy() for t in self._host)
        ]
        self._sent: list[Any] = [None] * len(self._host)
        self._cur = 0
        self._held = np.full(self.tensor.shape, -1, dtype=np.int32)
        """What the device tensor holds once the work issued so far ran."""
        self.source: tuple[Any, ...] | None = None
        """What the current host buffer (and so the tensor) was built from,
        as the runtime keys it; None after a reset (P2: a steady batch
        rebuilds nothing)."""
        self.copies = 0

    def host_views(self) -> tuple[np.ndarray, np.ndarray]:
        """The next host buffer, all -1: (row_req, req_state) to fill."""
        self._cur = (self._cur + 1) % len(self._host)
        event = self._sent[self._cur]
        if event is not None:
            event.synchronize()  # deliberate: the copy of two steps ago
        row_req, req_state, buf = self._host_np[self._cur]
        buf.fill(-1)
        return row_req, req_state

    def current(self) -> tuple[np.ndarray, np.ndarray]:
        """(row_req, req_state) as last filled, unchanged."""
        row_req, req_state, _ = self._host_np[self._cur]
        return row_req, req_state

    def send(self) -> None:
        """Copy the filled host buffer into the device tensor, unless the
        tensor holds the same values already (P2: no copy, no event)."""
        if not self.cuda:
            return
        buf = self._host_np[self._cur][2]
        if np.array_equal(buf, self._held):
            return
        self.tensor.copy_(self._host[self._cur], non_blocking=True)
        event = self._sent[self._cur] or torch.cuda.Event()
        event.record()
        self._sent[self._cur] = event
        self._held[:] = buf
        self.copies += 1

    def reset(self) -> None:
        """Padding only (-1): before a run outside a step (a dummy run, a
        capture, a DP rank's idle batch), which can replay a FULL graph
        that reads these inputs (F13). The runner calls it at the start of
        every such run (``before_dummy_run``)."""
        self.tensor.fill_(-1)
        self._held.fill(-1)
        self.source = None  # the next step rebuilds its host buffer


@dataclass(frozen=True)
class RuntimeGeometry:
    """The numbers the kernels take (spec 0, 3.2, 5.7)."""

    block_size: int
    row_bytes: int
    bytes_per_block: int
    attention_block_stride: int
    num_gpu_blocks: int
    num_host_blocks: int
    index_topk: int
    max_decode_query_len: int
    device_buffer_size: int
    max_num_seqs: int
    max_num_tokens: int
    num_staging_blocks: int = 0
    """Slab blocks past the pool for in-slab staging (K13)."""

    @property
    def host_rows(self) -> int:
        return self.num_host_blocks * self.block_size

    @property
    def workspace_rows(self) -> int:
        """R_ws = min(max_num_batched_tokens, max_num_seqs * q) (spec 2.8)."""
        return min(self.max_num_tokens, self.max_num_seqs * self.max_decode_query_len)


@dataclass
class SlotAllocator:
    """Request-state slots, one per live hot region (the worker owns them,
    2.8), kept by the region's request (how a batch row finds it, F22); the
    region (its first block, how the scheduler names it) names the request."""

    num_slots: int
    free: list[int] = field(default_factory=list)
    of_request: dict[str, int] = field(default_factory=dict)
    request_of_region: dict[int, str] = field(default_factory=dict)
    version: int = 0
    """Bumped by every assign and release (what a batch's slots derive from)."""

    def __post_init__(self) -> None:
        self.free = list(range(self.num_slots - 1, -1, -1))

    def assign(self, region: int, request_id: str) -> int:
        if region in self.request_of_region:
            raise RuntimeError(
                f"HiSparse: hot region {region} was allocated twice without a free"
            )
        if request_id in self.of_request:
            raise RuntimeError(
                f"HiSparse: request {request_id} got a second hot region ({region}) "
                "while its first is live (INV-5)"
            )
        if not self.free:
            raise RuntimeError(
                f"HiSparse: more than max_num_seqs={self.num_slots} hot regions "
                "are live"
            )
        slot = self.free.pop()
        self.version += 1
        self.of_request[request_id] = slot
        self.request_of_region[region] = request_id
        return slot

    def release(self, region: int) -> int | None:
        request_id = self.request_of_region.pop(region, None)
        if request_id is None:
            return None
        slot = self.of_request.pop(request_id)
        self.version += 1
        self.free.append(slot)
        return slot

    def of_region(self, region: int) -> int | None:
        """The slot of the region starting at block ``region``, if live."""
        request_id = self.request_of_region.get(region)
        return None if request_id is None else self.of_request[request_id]

    @property
    def num_live(self) -> int:
        return len(self.of_request)


class HiSparseRuntime:
    """GPU LRU state, slots, workspace and the decode-path launches (C7)."""

    def __init__(
        self,
        *,
        geometry: RuntimeGeometry,
        layers: Sequence[LayerViews],
        groups: Sequence[IndexGroup],
        resident_group_ids: Sequence[int],
        hot_group_ids: Sequence[int],
        source_group_id: int,
        tables: BatchState,
        ops: KernelOps,
        device: torch.device,
        order_misses: bool | str | None = None,
    ) -> None:
        self.geometry = geometry
        self.order_misses = order_mode(order_misses)
        """Gather each leader's misses in host-row order (docs/kernels.md
        P9: random reads of a large host pool run far below the link): None
        (K1's order), "row" (K6 sorts each plan row; True means this) or
        "step" (K7 sorts the whole step's cells as one list)."""
        self.layers: dict[str, LayerViews] = {lv.name: lv for lv in layers}
        self.groups = tuple(groups)
        self.hot = _shared_hot_state(self.groups)
        self.resident_group_ids = tuple(resident_group_ids)
        self.hot_group_ids = tuple(hot_group_ids)
        self.virtual_group_ids = frozenset(self.resident_group_ids + self.hot_group_ids)
        """KV-cache groups without an attention module (the runner builds no
        attention metadata for them: one set lookup per group per step)."""
        self.slotless_group_ids = frozenset(self.hot_group_ids)
        """KV-cache groups read by block id only: the runner neither pads
        their slot mappings nor maps their layers to one (P2)."""
        self.source_group_id = source_group_id
        self.tables = tables
        self.ops = ops
        self.device = device
        g = geometry
        self.slots = SlotAllocator(g.max_num_seqs)
        # Requests without a region share the extra state row S, which the
        # resolver never writes (all their pages are resident: INV-21,
        # INV-34).
        self.resident_only_slot = g.max_num_seqs
        self.step_inputs = StepInputs(g.max_num_tokens, g.max_num_seqs, device)
        self.row_req = self.step_inputs.row_req
        self.req_state = self.step_inputs.req_state
        self.workspace = Workspace.allocate(g.workspace_rows, g.index_topk, device)
        if self.order_misses == "step":
            cells = g.workspace_rows * g.index_topk
            temp = ops.order_step_temp_bytes(cells, g.host_rows, device)
            self.workspace.step_order = StepOrder.allocate(cells, temp, device)
        self._lru_init = torch.arange(
            g.device_buffer_size, dtype=torch.int16, device=device
        )
        self.num_reqs = 0
        self.num_tokens = 0
        self.step_active = False
        self.staged: dict[int, StagedRequest] = {}
        """Batch row -> staging plan of this step's host-backed prefills."""
        self.extend_plan: ExtendPlan | None = None
        """This step's decode-path extends (K13), if the decode rows of the
        batch are short prefill chunks rather than single tokens."""
        self.regions_assigned = 0
        self.slots_with_entries: set[int] = set()
        """Live slots whose hot rows may hold entries. Only a resolver miss
        inserts one, and only a request with a host-only context page (a
        null resident entry) can miss; a slot joins this set at the first
        step its request has one and leaves it when reset (assigned) or
        released. K4 runs while the set is not empty (P2: a prefix hit
        gets a region, and at no pressure all its pages are adopted, so
        no K4 launch per index group per step)."""
        self._slot_unchecked = np.zeros(g.max_num_seqs + 1, dtype=bool)
        """Per state slot: its request may have a host-only context page
        that ``slots_with_entries`` does not know of. Set when the slot is
        assigned and, for every slot, when residency updates arrive (the
        only other way a row gains a null resident entry: new pages are
        resident, new and resumed requests get a new region); cleared when
        checked. Row S (no region) stays False (P2: a steady step checks
        no row)."""
        self._maybe_unchecked = False
        """Some entry of ``_slot_unchecked`` may be True (P2: a steady step
        does not even index it)."""
        self.decode_split: tuple[int, int] | None = None
        """The target forward's (num_decodes, num_decode_tokens) this step."""
        self.draft_passes = 0
        """Draft-layer attention calls this step (one per draft pass)."""
        self.staging_blocks_peak = 0
        """Most in-slab staging blocks one step's extends used since the
        metrics sampler last read it (C12)."""
        self.prefill_seq_lens = np.zeros(0, dtype=np.int64)
        self.prefetch: FollowerPrefetch | None = None
        """Followers' gathers on a copy stream (``prefetch_followers``)."""

    def prefetch_followers(self, streams: Any) -> bool:
        """Gather each follower's misses on a copy stream as soon as its
        leader has planned them, so they overlap the leader's attention
        (spec 2.10, docs/worker.md K6). ``streams``: the worker's StreamOps.
        False (nothing set up) when no index group has a follower."""
        followers = [n for group in self.groups for n in group.layers[1:]]
        if followers:
            self.prefetch = FollowerPrefetch(streams, followers)
        return bool(followers)

    # ---------------------------------------------------------- geometry

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    def resident_group(self, layer: LayerViews) -> int:
        return self.resident_group_ids[layer.pair]

    def hot_group(self, layer: LayerViews) -> int:
        return self.hot_group_ids[layer.pair]

    # ------------------------------------------------------- hot regions

    def apply_hot_regions(
        self, freed: np.ndarray, allocated: np.ndarray, requests: Sequence[str]
    ) -> None:
        """Release the slots of freed regions, then give every new region
        (``requests[i]`` owns ``allocated[i]``) a freshly reset slot (INV-5,
        INV-24). Freed first: a block may end one region and start another
        in the same step, and a resumed request gets a new region."""
        if freed.size:
            released = [self.slots.release(int(b)) for b in freed]
            if any(s is None for s in released):
                missing = [int(b) for b, s in zip(freed, released) if s is None]
                raise RuntimeError(f"HiSparse: freed unknown hot regions {missing}")
            self.slots_with_entries.difference_update(released)
            self._slot_unchecked[released] = False
        if allocated.size:
            if len(requests) != allocated.size:
                raise RuntimeError(
                    f"HiSparse: {allocated.size} hot regions allocated for "
                    f"{len(requests)} requests"
                )
            self.regions_assigned += int(allocated.size)
            slots = [self.slots.assign(int(b), r) for b, r in zip(allocated, requests)]
            self.reset_slots(self._index(np.asarray(slots, dtype=np.int64)))
            self.slots_with_entries.difference_update(slots)
            self._slot_unchecked[slots] = True
            self._maybe_unchecked = True

    def note_residency_updates(self) -> None:
        """Residency updates rewrote resident table rows this step (lost or
        adopted pages): every slot's request is checked again."""
        self._slot_unchecked[: self.resident_only_slot] = True
        self._maybe_unchecked = True

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Every slot's dgi row to -1 and lru row to 0..H-1 (4.8 step 1),
        in every index group at once."""
        self.hot.dgi[:, slots] = -1
        self.hot.lru[:, slots] = self._lru_init

    def _index(self, values: np.ndarray) -> torch.Tensor:
        return to_device(values, self.device)

    # -------------------------------------------------- per-step inputs

    def prepare_forward(self, decode_split: tuple[int, int] | None = None) -> None:
        """Write this step's kernel inputs, outside any graph (INV-32, F13):
        ``row_req`` (the batch row of each real token, -1 for CUDA-graph
        padding) and ``req_state``, built on the host and sent in one copy.
        ``decode_split``: the forward's (num_decodes, num_decode_tokens),
        which the drafter's pass 0 must repeat (``begin_draft_pass``) for
        the real batch: a FULL graph pads a uniform decode batch with
        requests the drafter never sees (its metadata is unpadded).

        Both derive from the rows' query lengths, the request of each row
        and the slot of each request, and nothing else: a step whose three
        equal the last build's (a steady decode batch) rebuilds nothing
        (P2; docs/worker.md K42)."""
        num_reqs = self.num_reqs = self.tables.num_reqs()
        num_tokens = self.num_tokens = self.tables.num_tokens()
        if decode_split is not None:
            decodes, decode_tokens = decode_split
            decode_split = (min(decodes, num_reqs), min(decode_tokens, num_tokens))
        self.decode_split, self.draft_passes = decode_split, 0
        inputs = self.step_inputs
        # The query lengths as bytes: an exact compare without numpy's
        # per-call overhead (the key is small: num_reqs + 1 int32).
        qsl = self.tables.query_start_loc()[: num_reqs + 1].tobytes()
        rows = self.tables.req_rows()
        source = inputs.source
        if (
            source is None
            or source[0] != self.slots.version
            or source[1] != qsl
            or source[2] != rows
        ):
            row_req, req_state = inputs.host_views()
            row_req[:num_tokens] = self.tables.token_rows()[:num_tokens]
            self._request_slots(req_state[:num_reqs], rows)
            inputs.send()
            # Everything both arrays are built from (F22: slots by request).
            inputs.source = (self.slots.version, qsl, dict(rows))
        self._note_slots_that_may_miss(inputs.current()[1][:num_reqs])
        self.step_active = True

    def _note_slots_that_may_miss(self, state: np.ndarray) -> None:
        """Slots of this step's rows whose request has a host-only context
        page join ``slots_with_entries`` (before the forward whose resolver
        may fill them). Only unchecked slots are looked at: O(rows whose
        slot was assigned or whose residency changed)."""
        if not self._maybe_unchecked:
            return
        rows = np.nonzero(self._slot_unchecked[state])[0]
        if rows.size:
            self._slot_unchecked[state[rows]] = False
            seq = np.asarray(self.tables.seq_lens_cpu()[rows], dtype=np.int64)
            resident = self.tables.host(self.resident_group_ids[0])
            backed = host_backed_rows(resident, rows, seq, self.block_size)
            self.slots_with_entries.update(int(s) for s in state[backed])
        # Slots of requests outside this batch stay unchecked.
        self._maybe_unchecked = bool(self._slot_unchecked.any())

    def _request_slots(self, state: np.ndarray, rows: Mapping[str, int]) -> None:
        """Each row's request-state slot into ``state`` (int32 [num_reqs]),
        from the slots the worker gave to requests (F22), never from
        block-table rows: O(live hot regions)."""
        state.fill(self.resident_only_slot)
        if self.slots.of_request:
            num_reqs = state.shape[0]
            for request_id, slot in self.slots.of_request.items():
                row = rows.get(request_id)
                if row is not None and row < num_reqs:
                    state[row] = slot

    def plan_staging(self, num_decode_reqs: int) -> None:
        """Staging plans of this step's host-backed prefill requests (C11).

        Prefill rows follow the decode rows; a request needs staging when a
        context page of it has a null resident entry (vectorised over rows;
        only the host-backed ones get a per-request plan)."""
        self.staged = {}
        n = self.num_reqs
        self.prefill_seq_lens = np.asarray(
            self.tables.seq_lens_cpu()[:n], dtype=np.int64
        )
        rows = np.arange(num_decode_reqs, n)
        if rows.size == 0:
            return
        b = self.block_size
        resident = [self.tables.host(gid) for gid in self.resident_group_ids]
        backed = host_backed_rows(resident[0], rows, self.prefill_seq_lens[rows], b)
        if backed.size == 0:
            return
        source = self.tables.host(self.source_group_id)
        for row in backed.tolist():
            self.staged[row] = plan_staged_request(
                row, int(self.prefill_seq_lens[row]), resident, source, b, self.device
            )

    def plan_extends(self, num_decode_reqs: int) -> None:
        """The decode rows of this batch are short prefill chunks (FlashMLA
        sparse treats chunks up to its reorder threshold as decodes): plan
        their rows through an effective block table, null pages staged into
        the slab's staging blocks (K13). CPU numpy, once per forward."""
        g, b = self.geometry, self.block_size
        n = num_decode_reqs
        seq = np.asarray(self.tables.seq_lens_cpu()[:n], dtype=np.int64)
        width = int(-(-seq.max() // b)) if n else 0
        resident = [self.tables.host(gid)[:n, :width] for gid in self.resident_group_ids]
        live = context_pages(seq, width, b)
        null = (resident[0] == 0) & live
        count = int(null.sum())
        if count > g.num_staging_blocks:
            raise RuntimeError(
                f"HiSparse: {count} host-backed pages of short prefill chunks in one "
                f"step exceed the {g.num_staging_blocks} in-slab staging blocks"
            )
        self.staging_blocks_peak = max(self.staging_blocks_peak, count)
        ids = g.num_gpu_blocks + np.arange(count, dtype=np.int64)
        effective = []
        for table in resident:
            eff = np.where(live, table, 0).astype(np.int64)
            eff[null] = ids
            effective.append(to_device(eff, self.device, torch.int32))
        host_blocks = self.tables.host(self.source_group_id)[:n, :width][null]
        require_host_blocks(host_blocks, "host-only pages of short prefill chunks")
        src, dst, mask = page_copy_rows(host_blocks, ids, b, self.device)
        self.extend_plan = ExtendPlan(
            effective=tuple(effective),
            width=width,
            host_src_rows=src,
            dst_rows=dst,
            mask=mask,
        )

    def extend_rows(
        self,
        layer_name: str,
        num_decode_tokens: int,
        topk: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Attention rows of decode-path extend tokens (K13): resident pages
        at their resident row, host-only pages staged into the slab. The
        kernel then reads the same bytes, in the same order, as without
        HiSparse."""
        plan = self.extend_plan
        if plan is None:
            raise RuntimeError("HiSparse: no extend plan for a multi-token decode")
        lv = self.layers[layer_name]
        g, b = self.geometry, self.block_size
        if plan.host_src_rows.numel():
            self.ops.gather_plan(
                lv.host, lv.resident, plan.host_src_rows, plan.dst_rows, plan.mask
            )
        nd = num_decode_tokens
        # int32 throughout, in place where it can (the kernel's row ids are
        # int32, so int64 bought nothing): at most three int32 [nd, K]
        # temporaries live at once, not a handful of int64 ones (up to
        # ~640 MiB in a step of 8192 such rows at K = 2048; docs/layout.md
        # L17).
        req = self.row_req[:nd].clamp(min=0)
        pos = topk[:nd]
        page = torch.div(pos, b, rounding_mode="floor").clamp_(0, max(plan.width - 1, 0))
        rows = plan.effective[lv.pair][req.unsqueeze(1), page]  # block ids
        del page
        ok = (pos >= 0) & (pos < seq_lens[req].unsqueeze(1)) & (rows > 0)
        rows.mul_(g.attention_block_stride).add_(torch.remainder(pos, b))
        return rows.masked_fill_(~ok, -1)

    def begin_draft_pass(
        self, num_decodes: int, num_decode_tokens: int, query_start_loc: Any = None
    ) -> None:
        """A draft layer's attention call (one per draft pass; host ints, no
        sync). Pass 0 of the padded drafter batch runs the target's tokens
        and must split them as the target did: the step's staging and extend
        plans and mirror descriptors are for that split (docs/mtp.md 3.3)."""
        if not self.step_active:
            return  # a dummy or captured run: no step to match
        split = (int(num_decodes), int(num_decode_tokens))
        if self.draft_passes == 0 and self.decode_split not in (None, split):
            raise RuntimeError(
                "HiSparse: the drafter's first pass splits the batch into "
                f"(num_decodes, num_decode_tokens) = {split}, the target forward "
                f"into {self.decode_split}; the step's staging and mirror plans "
                "need the target's split (docs/mtp.md 3.3). The step has "
                f"{self.num_reqs} requests and {self.num_tokens} tokens; the draft "
                f"pass's query lengths are {_query_lens(query_start_loc)}"
            )
        self.draft_passes += 1

    def before_dummy_run(self) -> None:
        """A run outside a step is next (the runner's ``_dummy_run``): its
        graphs must see padding, not the last step's inputs (F13)."""
        self.step_inputs.reset()

    def end_forward(self) -> None:
        """The step is over. Its inputs stay on the device (the next step
        often sends the same: P2) until a dummy run resets them."""
        self.step_active = False
        self.decode_split, self.draft_passes = None, 0
        self.workspace.owner = None
        if self.prefetch is not None:
            self.prefetch.group = None
        self.staged = {}
        self.extend_plan = None

    # ------------------------------------------------------ decode path

    def decode_rows(
        self,
        layer_name: str,
        num_decode_tokens: int,
        topk: torch.Tensor,
        seq_lens: torch.Tensor,
        source_table: torch.Tensor,
        row_req: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention rows of the decode tokens of one layer (spec 2.10).

        The leader resolves top-k against the resident table, the hot LRU and
        the host pool, then gathers its misses; a follower replays its
        leader's plan with its own views. Fixed shapes, no host sync: safe
        inside a CUDA graph (INV-32).

        ``row_req`` (int32, the batch row of each token; K1 resolves each run
        of equal rows as one union group, INV-36): None for a target layer,
        the persistent ``self.row_req`` a FULL graph captures; a draft layer
        passes its pass's ``req_id_per_token`` (pass 0: the target's token
        rows; passes >= 1: one row per request; docs/mtp.md 3.3).

        Returns:
            out_rows int32 [nd, K] (attention row ids, -1 = masked) and
            valid_counts int32 [nd].
        """
        lv = self.layers[layer_name]
        group = lv.group
        ws = self.workspace
        nd = num_decode_tokens
        g = self.geometry
        if nd > g.workspace_rows:
            raise RuntimeError(
                f"HiSparse: {nd} decode rows exceed the resolver workspace of "
                f"{g.workspace_rows} rows (min(max_num_batched_tokens, "
                "max_num_seqs x max_decode_query_len)); F12"
            )
        if layer_name == group.leader:
            rq = seq_lens.shape[0]
            rows = self.row_req if row_req is None else row_req
            self.ops.resolve_residency(
                topk[:nd],
                rows[:nd],
                seq_lens,
                self.req_state[:rq],
                source_table[:rq],
                self.tables.device(self.resident_group(lv))[:rq],
                self.tables.device(self.hot_group(lv))[:rq],
                group.dgi,
                group.lru,
                g.host_rows,
                g.block_size,
                g.attention_block_stride,
                g.max_decode_query_len,
                ws.out_rows[:nd],
                ws.valid_counts[:nd],
                ws.plan_src[:nd],
                ws.plan_dst[:nd],
                ws.plan_count[:nd],
                None,
                None,
                group.stats,
                num_gpu_blocks=g.num_gpu_blocks,
            )
            self._order_misses(nd)
            ws.owner = group
            self._gather_misses(lv, nd)
            if self.prefetch is not None and len(group.layers) > 1:
                self.prefetch.enqueue(group, nd, self._gather_misses, self.layers)
        elif ws.owner is not group:
            raise RuntimeError(
                f"HiSparse: follower {layer_name} reached without its leader "
                f"{group.leader}'s plan (spec 2.10)"
            )
        elif self.prefetch is not None and self.prefetch.group is group:
            self.prefetch.join(layer_name)
        else:
            self._gather_misses(lv, nd)
        return ws.out_rows[:nd], ws.valid_counts[:nd]

    def _order_misses(self, nd: int) -> None:
        """The leader's miss order (docs/kernels.md P9): K6 sorts the plan's
        rows in place; K7 leaves the plan and writes the step's sorted cell
        list. Neither changes a (src, dst) pair (INV-36)."""
        ws = self.workspace
        if self.order_misses == "row":
            self.ops.order_plan(ws.plan_src[:nd], ws.plan_dst[:nd], ws.plan_count[:nd])
        elif self.order_misses == "step":
            order = ws.step_order
            self.ops.order_step(
                ws.plan_src[:nd],
                ws.plan_count[:nd],
                self.geometry.host_rows,
                *order.views(nd * self.geometry.index_topk),
                order.total,
                order.temp,
            )

    def _gather_misses(self, lv: LayerViews, nd: int) -> None:
        """K2 over the plan, or K7's gather over the leader's sorted list;
        a follower replays the same plan or list with its own views."""
        ws = self.workspace
        if self.order_misses == "step":
            order = ws.step_order
            _, _, _, sorted_cells = order.views(nd * self.geometry.index_topk)
            self.ops.gather_ordered(
                lv.host,
                lv.resident,
                ws.plan_src[:nd],
                ws.plan_dst[:nd],
                sorted_cells,
                order.total,
            )
            return
        self.ops.gather_compact(
            lv.host, lv.resident, ws.plan_src[:nd], ws.plan_dst[:nd], ws.plan_count[:nd]
        )

    # -------------------------------------------------- hot invalidation
    # Trigger 1 (a fresh slot for every region, apply_hot_regions) and
    # trigger 3 (rows a forward rewrote) cover every stale entry; spec 4.8's
    # trigger 2 (rows of reallocated host blocks) cannot find one: a live
    # slot keys only rows of its request's own host blocks, which stay
    # allocated while it lives (docs/worker.md K27).

    def invalidate_written(self, num_tokens: int) -> None:
        """K4 after the forward: hot entries of rows this forward rewrote
        (4.8 trigger 3), with the source slot mapping (host row per token)."""
        if not self.slots_with_entries or num_tokens == 0:
            return
        written = self.tables.slot_mapping(self.source_group_id)[:num_tokens]
        token_req = self.row_req[:num_tokens]
        # One launch for every index group: they share tokens, slots, rows.
        self.ops.invalidate_written_slots(self.hot.dgi, self.req_state, token_req, written)

    # --------------------------------------------------------- metrics

    def stats(self) -> dict[str, int]:
        """Resolver counters summed over the index groups (synchronizes:
        tests and periodic logging only, never on the decode path)."""
        total = torch.zeros(4, dtype=torch.int64)
        for group in self.groups:
            total += group.stats.view(torch.int64).cpu()
        hits, misses, tripped, rejected = (int(x) for x in total.tolist())
        return {
            "hits": hits,
            "misses": misses,
            "tripped_misses": tripped,
            "rejected_rows": rejected,
            "live_hot_regions": self.slots.num_live,
            "hot_regions_assigned": self.regions_assigned,
        }


class FollowerPrefetch:
    """The followers' miss gathers on a copy stream (spec 2.10 step 2.3).

    The leader's resolve and gather stay on the compute stream: its own
    attention waits for them, so a side stream would add two event
    operations and overlap nothing. Its followers' gathers only need the
    plan, so they are enqueued on the copy stream right behind it (fork:
    the copy stream waits on an event recorded after the leader's gather,
    which thus has the host link to itself) and run during the leader's
    attention; each follower's attention waits on its own ready event
    (join). Every fork is joined before the forward ends, as a CUDA graph
    capture requires.

    INV-9: the next leader's resolve, the only writer of the plan, is
    enqueued on the compute stream after every follower of this group has
    joined. The gathers read only persistent buffers (the host pool, the
    slab, the workspace), so no allocation crosses streams.
    """

    def __init__(self, streams: Any, followers: Sequence[str]) -> None:
        self.streams = streams
        self.stream = streams.new_stream("copy")
        self.plan_ready = streams.event("plan_ready")
        self.ready = {name: streams.event(f"ready:{name}") for name in followers}
        self.group: IndexGroup | None = None
        """The group whose followers were enqueued this forward (read while
        the model's Python runs: eager, or the capture of a graph)."""

    def enqueue(
        self,
        group: IndexGroup,
        nd: int,
        gather: Callable[[LayerViews, int], None],
        layers: Mapping[str, LayerViews],
    ) -> None:
        s = self.streams
        s.record(self.plan_ready, s.compute())
        with s.on(self.stream):
            s.wait(self.stream, self.plan_ready)
            for name in group.layers[1:]:
                gather(layers[name], nd)
                s.record(self.ready[name], self.stream)
        self.group = group

    def join(self, follower: str) -> None:
        self.streams.wait(self.streams.compute(), self.ready[follower])


def build_index_groups(
    sparse_layers: Sequence[str],
    leaders: Sequence[bool],
    pair_of_layer: Mapping[str, int],
    geometry: RuntimeGeometry,
    device: torch.device,
) -> list[IndexGroup]:
    """Index groups in model order: a leader starts one, followers join it
    (spec 2.10); a group never spans two pairs (INV-11)."""
    g = geometry
    groups: list[IndexGroup] = []
    members: list[list[str]] = []
    for name, is_leader in zip(sparse_layers, leaders):
        if is_leader or not members:
            members.append([])
        members[-1].append(name)
    states, width = g.max_num_seqs + 1, g.device_buffer_size
    hot = HotState(
        dgi=torch.full((len(members), states, width), -1, dtype=torch.int32, device=device),
        lru=torch.arange(width, dtype=torch.int16, device=device).repeat(
            len(members), states, 1
        ),
    )
    for index, names in enumerate(members):
        pairs = {pair_of_layer[n] for n in names}
        if len(pairs) != 1:
            raise ValueError(
                f"HiSparse: index group {names} spans resident/hot pairs "
                f"{sorted(pairs)} "
                "(INV-11)"
            )
        groups.append(
            IndexGroup(
                index=index,
                leader=names[0],
                layers=tuple(names),
                pair=pairs.pop(),
                dgi=hot.dgi[index],
                lru=hot.lru[index],
                stats=torch.zeros(4, dtype=torch.uint64, device=device),
                hot=hot,
            )
        )
    return groups


def _shared_hot_state(groups: Sequence[IndexGroup]) -> HotState:
    """The one HotState every group's views are of, in group order."""
    if not groups:
        raise ValueError("HiSparse: a runtime needs at least one index group")
    hot = groups[0].hot
    for i, group in enumerate(groups):
        if (
            group.hot is not hot
            or group.index != i
            or group.dgi.data_ptr() != hot.dgi[i].data_ptr()
            or group.lru.data_ptr() != hot.lru[i].data_ptr()
        ):
            raise ValueError(
                f"HiSparse: index group {i} ({group.leader}) is not view {i} of the "
                "shared hot state (runtime.build_index_groups)"
            )
    if hot.dgi.shape[0] != len(groups):
        raise ValueError(
            f"HiSparse: the hot state holds {hot.dgi.shape[0]} index groups, the "
            f"runtime {len(groups)}"
        )
    return hot


def _query_lens(query_start_loc: Any) -> list[int] | None:
    """Query lengths for an error message (an error path: a host copy)."""
    if query_start_loc is None:
        return None
    loc = query_start_loc.tolist()
    return [b - a for a, b in zip(loc, loc[1:])]


__all__ = [
    "BatchState",
    "FollowerPrefetch",
    "HiSparseRuntime",
    "HotState",
    "IndexGroup",
    "KernelOps",
    "LayerViews",
    "RuntimeGeometry",
    "SlotAllocator",
    "Workspace",
    "build_index_groups",
]
