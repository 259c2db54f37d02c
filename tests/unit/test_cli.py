"""The commands in scripts/ as a user meets them: --help and bad input.

--help of every script: complete usage text and nothing else. A bad flag or
an option without its value: a short error naming it, never a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir()
                 if p.is_file() and os.access(p, os.X_OK) and p.name != "lib.sh")
# What a user types; the *.py helpers are called by the other scripts.
COMMANDS = [p for p in SCRIPTS if p.suffix != ".py"]
UPSTREAM_KEYS = {ln.split("=", 1)[0] for ln in (ROOT / "UPSTREAM").read_text().splitlines()
                 if "=" in ln and not ln.startswith("#")}
# Arguments a command needs before it looks at the rest.
REQUIRED = {"hisparse-capacity": ["--preset", "glm-5.3"]}


def run(cmd: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=300)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# --- --help ------------------------------------------------------------------

SHELL_CODE = re.compile(r"^\s*(source\s|\.\s+\S+lib\.sh|set -|hs_\w|\[\[|#!)")
# A $NAME the script itself defines: a lower-case shell variable, lib.sh's
# HS_*, or a key of UPSTREAM (hs_usage fills those in). Upper-case names
# of environment variables the user sets ($OUT, $HISPARSE_OPS_LIBRARY) are
# documentation.
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# The last line is complete: it ends a sentence or a parenthesis, or it is an
# option or usage line (argparse ends with its options).
COMPLETE = re.compile(r"([.;!?)\]`'\"]\s*$)|(^\s*-)|(^\s*usage:)")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_is_complete_usage_text(script: Path):
    proc = run([str(script), "--help"])
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "usage:" in text.lower(), text
    code = [ln for ln in text.splitlines() if SHELL_CODE.match(ln)]
    assert not code, f"shell code in --help: {code}"
    unexpanded = [m for m in VAR.findall(text)
                  if m in UPSTREAM_KEYS or m.startswith("HS_") or not m.isupper()]
    assert not unexpanded, f"unexpanded variables in --help: {unexpanded}"
    last = lines(text)[-1]
    assert COMPLETE.search(last), f"--help ends mid-sentence: {last!r}"


def test_help_fills_in_the_pin_values():
    up = dict(ln.split("=", 1) for ln in (ROOT / "UPSTREAM").read_text().splitlines()
              if "=" in ln and not ln.startswith("#"))
    assert f"torch {up['TORCH_CPU_VERSION']} CPU build" in run(["scripts/build.sh", "--help"]).stdout
    assert f"git >= {up['GIT_MIN_VERSION']}," in run(["scripts/prereqs.sh", "--help"]).stdout


# --- bad input ----------------------------------------------------------------

def assert_short_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    err = lines(proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    # Our line comes last; vLLM's import may warn once before it (CPU tier).
    assert err and needle in err[-1] and len(err) <= 2, proc.stderr
    assert not re.search(r"line \d+: ", proc.stderr), proc.stderr  # no bash internals


@pytest.mark.parametrize("script", COMMANDS, ids=lambda p: p.name)
def test_unknown_flag_is_a_short_error(script: Path):
    proc = run([str(script), *REQUIRED.get(script.name, []), "--no-such-flag"])
    assert_short_error(proc, "--no-such-flag")


def valued_options(script: Path) -> list[str]:
    """The options a bash script's argument loop reads a value for."""
    return re.findall(r"^\s*(--[\w-]+)\) (?:hs_)?need ", script.read_text(), re.M)


MISSING_VALUE = [(p, opt) for p in COMMANDS if p.suffix == ".sh" for opt in valued_options(p)] + [
    (ROOT / "scripts/hisparse-capacity", "--context"),
    (ROOT / "scripts/bench-kernels", "--steps"),
    (ROOT / "scripts/bench-scheduler", "--steps"),
    (ROOT / "scripts/bench-tax", "--reps"),
    (ROOT / "scripts/bench-agentic", "--concurrency"),
]


@pytest.mark.parametrize(("script", "option"), MISSING_VALUE,
                         ids=[f"{p.name} {o}" for p, o in MISSING_VALUE])
def test_option_without_its_value_is_a_short_error(script: Path, option: str):
    proc = run([str(script), *REQUIRED.get(script.name, []), option])
    assert_short_error(proc, option)


def test_option_values_are_read_through_need():
    """So the sweep above finds them: ${2:?...} would name a bash line instead."""
    unchecked = [p.name for p in COMMANDS if p.suffix == ".sh" and "${2:?" in p.read_text()]
    assert not unchecked, unchecked
    assert len(MISSING_VALUE) > 20


def test_an_option_is_not_taken_as_the_previous_ones_value():
    assert_short_error(run(["scripts/build.sh", "--venv", "--no-install"]), "--venv needs a directory")


def test_unknown_test_tier_is_refused():
    assert_short_error(run(["scripts/test.sh", "--only", "bogus"]), "unknown tier 'bogus'")


def test_validate_refuses_a_second_argument():
    assert_short_error(run(["scripts/validate.sh", "--lint-only", "extra"]), "unknown argument: extra")
