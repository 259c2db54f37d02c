# SPDX-License-Identifier: Apache-2.0
"""Metrics tests (spec 2.12, 6.4, 6.5): the worker harness is importable
here too (it lives beside the worker tests, outside the package)."""

import sys
from pathlib import Path

_WORKER = str(Path(__file__).resolve().parent.parent / "worker")
if _WORKER not in sys.path:
    sys.path.insert(0, _WORKER)
