# SPDX-License-Identifier: Apache-2.0
"""pytest plugin for the nested run of tests/unit/test_fresh_clone.py.

That test runs the README's two commands again in a fresh clone whose PATH
has no `stg`, inside the tooling tier of a run that itself runs every tier
in full. scripts/test.sh loads this plugin into the hisparse and upstream
tiers only there (HISPARSE_FRESH_CLONE=1): every test module is still
collected (imported against the clone's own venv) and the first test of
each module runs; the rest are deselected, because the outer run runs all
of them on a venv built by the same scripts/build.sh from the same files,
and neither tier depends on the PATH the nested run is about. The tooling
tier, which drives stg and git through that PATH, runs in full.
"""

import os

import pytest

ENV = "HISPARSE_FRESH_CLONE"
_stats = {}


def pytest_configure(config):
    if os.environ.get(ENV) != "1":
        raise pytest.UsageError(
            f"fresh_clone_sample is for the nested fresh-clone run only ({ENV}=1); "
            "every other run must run every test")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    kept, dropped, seen = [], [], set()
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        (dropped if module in seen else kept).append(item)
        seen.add(module)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    _stats.update(kept=len(kept), total=len(kept) + len(dropped), modules=len(seen))


def pytest_terminal_summary(terminalreporter):
    if _stats:
        terminalreporter.write_line(
            "fresh-clone sample: {kept} of {total} tests ran, the first of each of "
            "{modules} modules (the outer run runs them all)".format(**_stats))
