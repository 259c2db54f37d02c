# SPDX-License-Identifier: Apache-2.0
"""pytest plugin: run vLLM's own unit suites on a machine without a GPU.

1. Force the CPU platform. Platform detection reads "cpu" in the installed
   version string; ours is 0.26.0+hisparse.<n>, so detection would give the
   UnspecifiedPlatform and DeviceConfig would fail to infer a device.
2. Mark every test skip_global_cleanup: tests/conftest.py otherwise calls
   torch.accelerator.empty_cache(), which raises without an accelerator.
Set HPLUG_FORCE_CPU_PLATFORM=0 to keep vLLM's own detection.
"""

import os

import pytest

if os.environ.get("HPLUG_FORCE_CPU_PLATFORM", "1") == "1":
    import vllm.platforms as _platforms
    from vllm.platforms.cpu import CpuPlatform

    _platforms._current_platform = CpuPlatform()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "skip_global_cleanup: skip vLLM's accelerator cleanup")


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
