# SPDX-License-Identifier: Apache-2.0
"""The e2e drivers' pure logic (tests/e2e/*.py) on the CPU: the modules
import nothing GPU-bound at import time."""

import sys
from pathlib import Path

_E2E = str(Path(__file__).resolve().parents[2] / "e2e")
if _E2E not in sys.path:
    sys.path.insert(0, _E2E)
