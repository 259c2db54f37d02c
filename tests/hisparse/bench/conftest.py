# SPDX-License-Identifier: Apache-2.0
"""The benchmark commands' logic (scripts/benchlib, scripts/bench-tax,
scripts/bench-agentic, scripts/bench-kernels) on the CPU: benchlib imports
only the standard library; what needs vLLM (its CLI parser, EngineArgs, the
layout) is imported by the tests that check against it."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "scripts"
HERE = Path(__file__).resolve().parent
for p in (str(SCRIPTS), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)


def load_command(name: str):
    """scripts/NAME (no .py) as a module, without running main()."""
    path = SCRIPTS / name
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.fixture
def bench_tax():
    return load_command("bench-tax")


@pytest.fixture
def bench_agentic():
    return load_command("bench-agentic")


@pytest.fixture(scope="module")
def bench_kernels():
    return load_command("bench-kernels")
