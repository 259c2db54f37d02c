# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HiSparseConnector: the KV connector of Hybrid HiSparse (spec C5/C6)."""
