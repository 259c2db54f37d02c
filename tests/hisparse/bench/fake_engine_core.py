# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's engine-core process as py-spy and
benchlib/pysample.py see it: a child titled ``VLLM::EngineCore`` (vLLM's
setproctitle replaces argv[0] the same way) that loops in ``schedule``
(~2 ms) and ``execute_model`` (~6 ms) until its parent exits. Used by
fake_vllm.py (FAKE_VLLM_ENGINE=1) and test_pysample.py."""

import signal
import subprocess
import sys

TITLE = "VLLM::EngineCore"
SCHEDULE_S, EXECUTE_S = 0.002, 0.006
SOURCE = f"""
import os, time
def spin(s):
    t = time.time()
    while time.time() - t < s: pass
def schedule(): spin({SCHEDULE_S})
def execute_model(): spin({EXECUTE_S})
parent = os.getppid()
while os.getppid() == parent:  # ends with its parent
    schedule(); execute_model()
"""


def spawn() -> subprocess.Popen:
    """The titled engine as a child of the calling process (bash execs
    python under the title: no shell stays in between)."""
    return subprocess.Popen(["bash", "-c", f'exec -a {TITLE} "$0" -c "$1"',
                             sys.executable, SOURCE])


if __name__ == "__main__":  # a parent for the engine, for tests: lives until killed
    spawn()
    signal.pause()
