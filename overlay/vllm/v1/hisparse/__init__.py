# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hybrid HiSparse: a host-offloaded KV cache for sparse-MLA models.

The pinned host pool is the source of truth; GPU-resident pages are a
write-back cache of it; each request under pressure gets a small GPU hot
buffer (an LRU of host rows) filled by a fused CUDA resolver. Every module of
this package is inert unless ``attention_config.hisparse_config`` is set.
"""
