"""The commands in scripts/ as a user meets them: --help and bad input
(issue 17 item 6, "the newcomer's path").

Every executable in scripts/ is a command; the libraries (lib.sh, scriptlib.py)
are not executable. --help: the whole usage text (the script's header or
docstring, every line of it) and nothing else, exit 0. Bad input (an unknown
flag, an option without its value, a value it cannot use): exit status != 0,
exactly one line on stderr that starts with the command's name or 'error',
nothing on stdout, never a traceback.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file() and os.access(p, os.X_OK))
LIBRARIES = [ROOT / "scripts/lib.sh", ROOT / "scripts/scriptlib.py"]
# What a user types; the *.py helpers are mostly called by the other scripts.
COMMANDS = [p for p in SCRIPTS if p.suffix != ".py"]
UPSTREAM = dict(ln.split("=", 1) for ln in (ROOT / "UPSTREAM").read_text().splitlines()
                if "=" in ln and not ln.startswith("#"))
# Arguments a command needs before it looks at the rest.
REQUIRED = {"hisparse-capacity": ["--preset", "glm-5.3"]}


def run(cmd: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=300)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_the_libraries_are_not_commands():
    """issue 17 item 6: `scripts/lib.sh --help` ran lib.sh under sh ("set:
    Illegal option -o pipefail"); the libraries are not executable, every
    command names its interpreter."""
    assert SCRIPTS and not [p.name for p in LIBRARIES if os.access(p, os.X_OK)]
    assert not [p.name for p in SCRIPTS if not p.read_text().startswith("#!")]


# --- --help ------------------------------------------------------------------

SHELL_CODE = re.compile(r"^\s*(source\s|\.\s+\S+lib\.sh|set -|hs_\w|\[\[|#!|import \w|from \S+ import )")
# A $NAME the script itself defines: a lower-case shell variable, lib.sh's
# HS_*, or a key of UPSTREAM (hs_usage fills those in). Upper-case names
# of environment variables the user sets ($OUT, $HISPARSE_OPS_LIBRARY) are
# documentation.
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# The last line is complete: it ends a sentence or a parenthesis, or it is an
# option or usage line (argparse ends with its options).
COMPLETE = re.compile(r"([.;!?)\]`'\"]\s*$)|(^\s*-)|(^\s*usage:)")


def header_text(script: Path) -> str:
    """What --help must show, read independently of lib.sh's awk: a Python
    command's docstring; a shell script's comment block after the shebang and
    SPDX lines, up to its first line of code, with UPSTREAM's values in."""
    text = script.read_text()
    if text.startswith("#!/usr/bin/env python"):
        return ast.get_docstring(ast.parse(text), clean=True) or ""
    out = []
    for ln in text.splitlines()[1:]:
        if ln.startswith("# SPDX-"):
            continue
        if not ln.startswith("#"):
            break
        out.append(re.sub(r"^# ?", "", ln))
    header = "\n".join(out)
    for key in sorted(UPSTREAM, key=len, reverse=True):
        header = header.replace("${%s}" % key, UPSTREAM[key]).replace("$" + key, UPSTREAM[key])
    return header


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_is_the_complete_usage_text(script: Path):
    """issue 17 item 6: --help of every command, clean and complete."""
    proc = run([str(script), "--help"])
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = proc.stdout
    assert len(re.findall(r"^usage:", text, re.M | re.I)) == 1, text  # one usage, not two
    code = [ln for ln in text.splitlines() if SHELL_CODE.match(ln)]
    assert not code, f"code in --help: {code}"
    unexpanded = [m for m in VAR.findall(text)
                  if m in UPSTREAM or m.startswith("HS_") or not m.isupper()]
    assert not unexpanded, f"unexpanded variables in --help: {unexpanded}"
    last = lines(text)[-1]
    assert COMPLETE.search(last), f"--help ends mid-sentence: {last!r}"
    shown = {ln.strip() for ln in text.splitlines()}
    missing = [ln for ln in header_text(script).splitlines() if ln.strip() and ln.strip() not in shown]
    assert not missing, f"--help leaves out lines of the header: {missing}"


def test_help_fills_in_the_pin_values():
    """issue 17 item 6: build.sh's help showed a literal $TORCH_CPU_VERSION."""
    assert f"torch {UPSTREAM['TORCH_CPU_VERSION']} CPU build" in run(["scripts/build.sh", "--help"]).stdout
    assert f"git >= {UPSTREAM['GIT_MIN_VERSION']}," in run(["scripts/prereqs.sh", "--help"]).stdout


def test_help_fills_in_braced_and_longest_keys(tmp_path: Path):
    """issue 17 item 6: hs_usage fills in ${KEY} as well as $KEY, and a key
    is never read as a shorter key followed by text."""
    script = tmp_path / "scripts" / "probe.sh"
    script.parent.mkdir()
    script.write_text("#!/usr/bin/env bash\n# a ${VLLM_VERSION} b $VLLM_BASE_VERSION c $VLLM_WHEEL_FILE.\n"
                      f"source {ROOT}/scripts/lib.sh\nhs_usage\n")
    proc = run(["bash", str(script)])
    assert proc.stdout == (f"a {UPSTREAM['VLLM_VERSION']} b {UPSTREAM['VLLM_BASE_VERSION']} "
                           f"c {UPSTREAM['VLLM_WHEEL_FILE']}.\n"), proc.stderr


# --- bad input ----------------------------------------------------------------

def assert_one_line_error(proc: subprocess.CompletedProcess, script: Path, needle: str | None) -> None:
    name = re.escape(script.name)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    err = lines(proc.stderr)
    assert len(err) == 1, f"not one line: {proc.stderr}"
    assert re.match(rf"(\[{name}\]|{name}[: ]|error\b)", err[0]), err[0]
    assert needle is None or needle in err[0], err[0]
    assert proc.stdout == ""
    assert not re.search(r"line \d+: ", proc.stderr), proc.stderr  # no bash internals


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_unknown_flag_is_a_one_line_error(script: Path):
    """issue 17 item 6: an unknown flag, for every command. A *.py helper
    without its subcommand says which are required (argparse checks those
    first), so the flag is named by the commands only."""
    proc = run([str(script), *REQUIRED.get(script.name, []), "--no-such-flag"])
    assert_one_line_error(proc, script, "--no-such-flag" if script in COMMANDS else None)


def valued_options(script: Path) -> list[str]:
    """The options a bash script's argument loop reads a value for."""
    found = re.findall(r"^\s*((?:--[\w-]+\|?)+)\) (?:hs_)?need ", script.read_text(), re.M)
    return [opt for alts in found for opt in alts.split("|")]


MISSING_VALUE = [(p, opt) for p in COMMANDS if p.suffix == ".sh" for opt in valued_options(p)] + [
    (ROOT / "scripts/hisparse-capacity", "--context"),
    (ROOT / "scripts/bench-kernels", "--steps"),
    (ROOT / "scripts/bench-scheduler", "--steps"),
    (ROOT / "scripts/bench-tax", "--reps"),
    (ROOT / "scripts/bench-agentic", "--concurrency"),
]


@pytest.mark.parametrize(("script", "option"), MISSING_VALUE,
                         ids=[f"{p.name} {o}" for p, o in MISSING_VALUE])
def test_option_without_its_value_is_a_one_line_error(script: Path, option: str):
    """issue 17 item 6: an option at the end of the line, without its value."""
    proc = run([str(script), *REQUIRED.get(script.name, []), option])
    assert_one_line_error(proc, script, option)


def test_option_values_are_read_through_need():
    """So the sweep above finds them: ${2:?...} would name a bash line instead."""
    unchecked = [p.name for p in COMMANDS if p.suffix == ".sh" and "${2:?" in p.read_text()]
    assert not unchecked, unchecked
    assert len(MISSING_VALUE) > 20
    assert ("build-kernels.sh", "--jobs") in {(p.name, o) for p, o in MISSING_VALUE}


# (command, arguments, what the one line says): values the commands cannot
# use, refused before any work starts (all of them within seconds, offline).
BAD_VALUES = [
    ("build.sh", ["--venv", "--no-install"], "--venv needs a directory"),
    ("build.sh", ["--tier", "tpu"], "--tier must be cpu or gpu"),
    ("prereqs.sh", ["--tier", "tpu"], "--tier must be cpu or gpu"),
    ("test.sh", ["--only", "bogus"], "unknown tier 'bogus'"),
    ("test.sh", ["--venv", "/nonexistent"], "run scripts/build.sh first"),
    ("test-gpu.sh", ["--only", "bogus"], "unknown tier 'bogus'"),
    ("validate.sh", ["--lint-only", "extra"], "unknown argument: extra"),
    ("bisect-check.sh", ["--python", "/nonexistent"], "run scripts/build.sh"),
    ("build-wheel.sh", ["--jobs", "abc"], "--jobs must be a positive integer"),
    ("bundle.sh", ["--jobs", "0"], "--jobs must be a positive integer"),
    ("bundle.sh", ["--part-mib", "abc"], "--part-mib must be a number"),
    ("build-kernels.sh", ["--jobs=x"], "--jobs must be a positive integer"),
    ("check-gpu-wheel.sh", ["/nonexistent.whl"], "no such wheel"),
    ("fetch.sh", [], "no such file: /nonexistent (HISPARSE_SDIST"),  # the env below
    ("rebase.sh", [], "usage: scripts/rebase.sh VERSION"),
    ("rebase.sh", [UPSTREAM["VLLM_VERSION"]], "is the pin already"),
    ("upstream-pr.sh", [], "usage: scripts/upstream-pr.sh PATCH"),
    ("upstream-pr.sh", ["no-such-patch"], "no patch 'no-such-patch'"),
    ("build-image.sh", ["--dry-run", "--digest", "sha256:1234"], "is not sha256:<64 hex digits>"),
    ("hisparse-capacity", [], "one of the arguments --preset --config is required"),
    ("hisparse-capacity", ["--preset", "nope"], "invalid choice: 'nope'"),
    ("hisparse-capacity", ["--preset", "glm-5.3", "--tensor-parallel-size", "0"], "must be > 0"),
    ("bench-kernels", ["--steps", "abc"], "invalid int value: 'abc'"),
    ("bench-kernels", ["--context", "100"], "--context 100 is too small"),
    ("bench-kernels", ["--scenarios", "bogus"], "--scenarios: unknown bogus"),
    ("bench-scheduler", ["--steps", "0"], "must be > 0"),
    ("bench-tax", ["--arms", "bogus", "--dry-run"], "unknown arm bogus"),
    ("bench-agentic", ["--arms", "bogus", "--dry-run"], "unknown arm bogus"),
    ("patchtool.py", ["hunk"], "the following arguments are required"),
]


@pytest.mark.parametrize(("name", "args", "needle"), BAD_VALUES,
                         ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD_VALUES])
def test_bad_value_is_a_one_line_error(name: str, args: list[str], needle: str, tmp_path: Path):
    """issue 17 item 6: bad values, refused in one line, before any work.
    Should a regression let a build start, it fails at once: its work goes
    to a scratch folder and the pin's files point nowhere (no download)."""
    script = ROOT / "scripts" / name
    scratch = {f"HISPARSE_{k}": str(tmp_path / k.lower()) for k in ("WORK", "OUT", "CACHE")}
    proc = run([str(script), *args], env={**scratch, "HISPARSE_SDIST": "/nonexistent",
                                         "HISPARSE_WHEEL": "/nonexistent"})
    assert_one_line_error(proc, script, needle)


def test_export_check_before_the_stack_exists(tmp_path: Path):
    """issue 17 item 6: `scripts/export.sh --check` on a fresh clone (no
    work/vllm yet) says, in one line, that the stack is missing and to run
    scripts/stack.sh; a folder that is not a stack is one line too."""
    env = {"HISPARSE_WORK": str(tmp_path / "work"), "HISPARSE_OUT": str(tmp_path / "out")}
    export = ROOT / "scripts/export.sh"
    proc = run([str(export), "--check"], env=env)
    assert_one_line_error(proc, export, f"no stack at {tmp_path}/work/vllm: run scripts/stack.sh first")
    (tmp_path / "plain").mkdir()
    proc = run([str(export), "--check", "--from", str(tmp_path / "plain")], env=env)
    assert_one_line_error(proc, export, None)
    assert "run scripts/stack.sh first" in proc.stderr or "stgit is not installed" in proc.stderr
    assert not (tmp_path / "out").exists()
