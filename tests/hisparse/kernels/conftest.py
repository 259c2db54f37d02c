# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel-test plumbing: the shared case builders, and the GPU gate.

GPU tests take the ``gpu_kernels`` fixture. It skips (never fails) when no
CUDA device is visible or when the hisparse_ops extension is not built for
this torch, so the whole folder runs on CPU-only CI machines.
"""

import sys
from pathlib import Path

import pytest

# The sibling helper module must import under any pytest import mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def gpu_kernels():
    """vllm.v1.hisparse.kernels with the extension loaded, or a skip."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm.v1.hisparse import kernels

    op = kernels.missing_op()
    if op is not None:
        pytest.skip(f"hisparse_ops extension not available (missing {op}); "
                    "build it with scripts/build-kernels.sh")
    return kernels
