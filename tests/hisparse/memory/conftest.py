# SPDX-License-Identifier: Apache-2.0
"""Memory-accounting tests: they reuse the worker harness and the layout
builders, so both sibling folders go on the import path."""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _folder in ("worker", "layout"):
    _path = str(_ROOT / _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)
