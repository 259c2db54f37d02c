# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixed HiSparse protocol and layout constants (spec 6.1: not user-settable).

They are part of the design's invariants, so they live here rather than in
``HiSparseConfig``: a value that a config could change would let a deployment
break the guarantees the scheduler and the kernels rely on.
"""

from vllm.config.hisparse import MAX_DEVICE_BUFFER_SIZE

# Output pages per request an admission keeps free for the decode growth of
# the groups that never give a page back (the indexer; docs/residency.md
# R34): cdiv(min(prompt + max_tokens, max_model_len), B) pages less those
# the request holds, at most this many (32 pages are 2,048 tokens at B = 64:
# an agentic turn's answer fits; a request without max_tokens, whose limit
# is the context length, does not hold back a whole context's worth).
DECODE_RESERVE_MAX_PAGES = 32
# An admission that failed for lack of blocks is not looked up again while
# the blocks available to it are no more than at the failure, for at most
# this many steps (docs/residency.md R35): its prefix lookups cost ~1 ms a
# step on the serving host, and a bound keeps a prefix hit that grew in the
# meantime (a publication) from waiting long.
ADMISSION_RETRY_STEPS = 8

# Tail pages of every request that are never unpinned (INV-20, spec 4.5). The
# resident admission cap adds them on top of the in-flight window (spec 2.4).
ACTIVE_TAIL_PAGES = 2

# Scheduling attempts an admission waits for a finished request's pages to be
# published before it computes them itself (docs/residency.md R30). Spills
# land within a few steps; the bound keeps a publication that never lands
# from holding the request back forever.
MAX_PUBLICATION_WAITS = 64

# Scheduling attempts a P/D import that is not admissible waits (neither its
# device nor its host landing fits, spec 4.13 step 1) before the request
# computes its prompt itself (docs/pd-imports.md). The same bound as R30: an
# import never holds a request back forever, and never preempts (INV-30).
MAX_IMPORT_WAITS = 64

# The pinned host pool may use at most this fraction of the RAM that psutil
# reports as available when the check runs (spec 3.3, 6.3 #13).
HOST_RAM_LIMIT_FRACTION = 0.95

# Largest single cudaHostRegister range (spec 3.3, F14): one registration of
# 512 GiB or more fails, and a batched copy rejects a descriptor spanning two.
REGISTRATION_CHUNK_BYTES = 256 << 30

# Host pool registration boundaries are multiples of the OS page (spec 3.3).
OS_PAGE_BYTES = 4096

# Row ids (GPU physical/attention rows, host global rows) are stored as int32
# (INV-14): every id must be <= this value.
MAX_INT32_ROW_ID = (1 << 31) - 1

# Kernels move rows as 16-byte vectors (spec 3.4).
ROW_ALIGN_BYTES = 16

# Sparse-MLA KV row widths W (spec 3.4).
FP8_DS_MLA_ROW_BYTES = 656  # 512 B fp8 NoPE + 16 B scales + 128 B bf16 RoPE
BF16_MLA_ROW_BYTES = 1152  # 576 bf16 elements (kv_lora_rank 512 + RoPE 64)

# The TP rank that creates and alone writes a shared host pool (spec 4.12,
# INV-28); the scheduler counts only its spill acks in shared mode.
HOST_WRITER_RANK = 0

# The worker samples the resolver's device counters every this many steps
# (spec 2.12 says 2000; docs/worker.md K21): an asynchronous copy of a few
# dozen bytes per index group, read back by event query a later step.
STATS_INTERVAL_STEPS = 100

# Virtual layer-name suffixes of the resident and hot groups (spec 3.1).
RESIDENT_SUFFIX = ".hisparse_resident"
HOT_SUFFIX = ".hisparse_hot"

# Layer-name suffixes that 0.26.0's DeepSeek-V2/V3.2 model code gives the
# sparse-MLA attention layer and its indexer key cache
# (model_executor/layers/mla.py: f"{prefix}.attn";
# models/deepseek_v2.py: f"{prefix}.indexer" + ".k_cache").
MLA_ATTN_SUFFIX = ".attn"
INDEXER_CACHE_SUFFIX = ".indexer.k_cache"

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "MAX_IMPORT_WAITS",
    "MAX_PUBLICATION_WAITS",
    "BF16_MLA_ROW_BYTES",
    "FP8_DS_MLA_ROW_BYTES",
    "HOST_RAM_LIMIT_FRACTION",
    "HOST_WRITER_RANK",
    "HOT_SUFFIX",
    "INDEXER_CACHE_SUFFIX",
    "MAX_DEVICE_BUFFER_SIZE",
    "MAX_INT32_ROW_ID",
    "MLA_ATTN_SUFFIX",
    "OS_PAGE_BYTES",
    "REGISTRATION_CHUNK_BYTES",
    "RESIDENT_SUFFIX",
    "ROW_ALIGN_BYTES",
    "STATS_INTERVAL_STEPS",
]
