"""The Python commands of scripts/ (bench-kernels, bench-scheduler,
hisparse-capacity, bench-tax, bench-agentic) and build-kernels.sh: the interpreter they pick, and
hisparse-capacity's answer to a --config it cannot use (issue 17 item 6).

A command started by an interpreter without torch / the patched vLLM re-runs
itself with the repository's .venv/bin/python; without a .venv it says, in
one line, to run scripts/build.sh (exit status 2). --help and usage errors
come first and need neither. Here a stand-in .venv/bin/python reports how it
was called, and `python -E -S` plays the interpreter without them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


from test_cli import header_text, lines, run  # one way to run a command (tests/unit is on sys.path)


# --- hisparse-capacity --config ---------------------------------------------------

DENSE = json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
SPARSE = {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "index_topk": 2048, "index_head_dim": 128}
# case: (--config, relative to tmp_path; files to write there; what the error says after --config)
BAD_CONFIGS = {
    "missing": ("nope.json", {}, "nope.json: no such file or folder"),
    "folder-without-config-json": ("empty", {"empty/README": ""}, "empty: a folder without config.json"),
    "invalid-json": ("bad.json", {"bad.json": "{not json"}, "bad.json: not valid JSON"),
    "not-an-object": ("list.json", {"list.json": "[1, 2]"}, "list.json: not a JSON object"),
    "no-index-topk": ("dense/config.json", {"dense/config.json": DENSE},
                      "dense/config.json has no index_topk: not a sparse-MLA model"),
    "no-index-topk-folder": ("dense", {"dense/config.json": DENSE},
                             "dense/config.json has no index_topk: not a sparse-MLA model"),
    # a sparse-MLA config without the sizes its KV cache is built from
    "no-kv-lora-rank": ("c.json", {"c.json": json.dumps({**SPARSE, "kv_lora_rank": None})},
                        "c.json has no kv_lora_rank (a sparse-MLA config.json has num_hidden_layers"),
    "size-not-an-integer": ("c.json", {"c.json": json.dumps({**SPARSE, "index_topk": "x"})},
                            "c.json: index_topk is 'x', not a positive integer"),
    "negative-layers": ("c.json", {"c.json": json.dumps({**SPARSE, "num_hidden_layers": -1})},
                        "c.json: num_hidden_layers is -1, not a positive integer"),
}
# A setting the checks before vLLM's import do not cover: the spec builder's
# own error, in one line (imports vLLM: run under the .venv).
UNUSABLE = ("c.json", {"c.json": json.dumps({**SPARSE, "index_topk_freq": 0})},
            "c.json: unusable model settings (")


@pytest.mark.parametrize("case", [*sorted(BAD_CONFIGS), "unusable"])
def test_capacity_bad_config_is_one_line_naming_the_file(case: str, tmp_path: Path):
    """issue 17 item 6: a --config it cannot use is one line naming the file
    and the problem, exit 2, never a traceback."""
    arg, files, problem = UNUSABLE if case == "unusable" else BAD_CONFIGS[case]
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    proc = run([sys.executable, str(ROOT / "scripts/hisparse-capacity"), "--config", str(tmp_path / arg)])
    err = lines(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert len(err) == 1 and err[0].startswith(f"hisparse-capacity: error: --config {tmp_path}/{problem}"), \
        proc.stderr


# --- the interpreter: the repository's .venv ----------------------------------------

FAKE_VENV_PYTHON = '#!/bin/sh\necho "venv python ($HISPARSE_VENV_REEXEC): $*"\n'
# Arguments that parse and then need torch / vLLM.
PYTHON_COMMANDS = {"bench-kernels": ["--dry-run"], "bench-scheduler": ["--steps", "1"],
                   "hisparse-capacity": ["--preset", "glm-5.3"],
                   # a run of our arms: their engines run on this interpreter
                   "bench-tax": ["--arms", "off,on"], "bench-agentic": ["--arms", "plain"]}


def repo_copy(tmp: Path, venv: bool) -> Path:
    """scripts/ alone, with a stand-in .venv/bin/python that says how it was called."""
    repo = tmp / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    if venv:
        py = repo / ".venv/bin/python"
        py.parent.mkdir(parents=True)
        py.write_text(FAKE_VENV_PYTHON)
        py.chmod(0o755)
    return repo


def bare_python(script: Path, *args: str) -> list[str]:
    """An interpreter that cannot import torch or vLLM: no site-packages, no PYTHONPATH."""
    return [sys.executable, "-E", "-S", str(script), *args]


@pytest.mark.parametrize("name", sorted(PYTHON_COMMANDS))
def test_python_command_reruns_under_the_venv(name: str, tmp_path: Path):
    repo = repo_copy(tmp_path, venv=True)
    script = repo / "scripts" / name
    proc = run(bare_python(script, *PYTHON_COMMANDS[name]), cwd=repo,
               env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"venv python (1): {script} {' '.join(PYTHON_COMMANDS[name])}"


@pytest.mark.parametrize("name", sorted(PYTHON_COMMANDS))
def test_python_command_without_a_venv_is_one_line(name: str, tmp_path: Path):
    repo = repo_copy(tmp_path, venv=False)
    proc = run(bare_python(repo / "scripts" / name, *PYTHON_COMMANDS[name]), cwd=repo,
               env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(lines(proc.stderr)) == 1 and "run scripts/build.sh first" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", sorted(PYTHON_COMMANDS))
def test_help_and_usage_errors_need_no_venv(name: str, tmp_path: Path):
    """issue 17 item 6: on a fresh clone (no .venv, an interpreter without
    torch or vLLM), --help is the whole text and a bad flag is one line: the
    arguments are parsed before the interpreter is settled."""
    repo = repo_copy(tmp_path, venv=False)
    script = repo / "scripts" / name
    proc = run(bare_python(script, "--help"), cwd=repo, env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    shown = {ln.strip() for ln in proc.stdout.splitlines()}
    assert all(ln.strip() in shown for ln in header_text(script).splitlines()), proc.stdout
    proc = run(bare_python(script, "--no-such-flag"), cwd=repo, env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert lines(proc.stderr) == [f"{name}: error: " + (
        "one of the arguments --preset --config is required (see --help)" if name == "hisparse-capacity"
        else "unrecognized arguments: --no-such-flag (see --help)")]


def test_build_kernels_uses_the_venv_python(tmp_path: Path):
    repo = repo_copy(tmp_path, venv=True)
    proc = run([str(repo / "scripts/build-kernels.sh"), "--compile-only"], cwd=repo,
               env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 0, proc.stderr
    assert lines(proc.stdout)[-1] == (f"venv python (): {repo}/overlay/csrc/hisparse/build.py "
                                      f"--build-dir {repo}/build/hisparse_ops --compile-only")


def test_build_kernels_without_a_venv_is_one_line(tmp_path: Path):
    repo = repo_copy(tmp_path, venv=False)
    proc = run([str(repo / "scripts/build-kernels.sh"), "--compile-only"], cwd=repo)
    assert proc.returncode == 2 and proc.stdout == ""
    assert lines(proc.stderr) == [
        "[build-kernels.sh] error: no .venv/bin/python: run scripts/build.sh first (or pass --python PY)"]


@pytest.mark.parametrize("name, args, needle", [
    ("bench-tax", ["--dry-run"], "estimate: engine starts"),
    ("bench-agentic", ["--dry-run"], "estimate (rough)"),
    # upstream's arms run on its own bundle: no .venv needed for them either
    ("bench-agentic", ["--arms", "upstream", "--dry-run"], "HiSparseConnector"),
])
def test_bench_planning_needs_only_the_standard_library(name, args, needle, tmp_path):
    """--dry-run (and --merge, --plot's data) run on any Python: the
    benchmark library imports nothing but the standard library."""
    repo = repo_copy(tmp_path, venv=False)
    proc = run(bare_python(repo / "scripts" / name, *args), cwd=repo,
               env={"HISPARSE_VENV_REEXEC": None})
    assert proc.returncode == 0, proc.stderr
    assert needle in proc.stdout
