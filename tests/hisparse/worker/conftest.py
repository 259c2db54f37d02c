# SPDX-License-Identifier: Apache-2.0
"""Worker-side tests: the sibling harness module imports under any mode."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
