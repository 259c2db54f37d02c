# SPDX-License-Identifier: Apache-2.0
"""Shared by the Python commands in scripts/ (what lib.sh is to the bash ones).

use_venv(*modules)  run the command under the repository's .venv/bin/python
                    (scripts/build.sh installs the patched vLLM there) when
                    the interpreter it started with cannot import `modules`;
                    without one, a one-line error and exit status 2.
ArgumentParser      argparse whose usage errors are one line.
doc_parser(doc)     an ArgumentParser whose --help is the command's whole
                    docstring (its own usage lines, if it has them, instead
                    of argparse's), then argparse's option list.

A command parses its arguments before it calls use_venv or imports anything
heavy, so that --help and a usage error need neither the .venv nor vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
# Set for the re-executed process, so that a .venv which lacks the modules
# too ends in the error below instead of an exec loop.
REEXEC_ENV = "HISPARSE_VENV_REEXEC"


def _first_missing(modules: tuple[str, ...]) -> str | None:
    # find_spec imports only the parent packages: no side effects of the
    # module itself (the caller may need to set things up before it loads).
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError as exc:
            return f"{name} ({exc})"
    return None


def use_venv(*modules: str, hint: str = "") -> None:
    """Return if `modules` can be imported; else re-execute the command with
    .venv/bin/python, or exit with one line that says what to do."""
    missing = _first_missing(modules)
    if missing is None:
        os.environ.pop(REEXEC_ENV, None)  # not inherited by what this runs
        return
    if os.environ.get(REEXEC_ENV) != "1" and VENV_PYTHON.exists():
        os.environ[REEXEC_ENV] = "1"
        script = os.path.abspath(sys.argv[0])
        os.execv(VENV_PYTHON, [str(VENV_PYTHON), script, *sys.argv[1:]])
    prog = os.path.basename(sys.argv[0])
    if VENV_PYTHON.exists():
        problem = f"{VENV_PYTHON} cannot import {missing}"
    else:
        problem = f"{sys.executable} cannot import {missing} and there is no .venv"
    print(f"{prog}: error: {problem}: run scripts/build.sh first{hint}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """Usage errors as one line naming the problem; --help has the rest."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def doc_parser(doc: str, **kwargs) -> ArgumentParser:
    """The command's docstring as its --help, as written (a usage line in it
    replaces argparse's), followed by argparse's list of options."""
    if re.search(r"^usage: ", doc, re.M):
        kwargs.setdefault("usage", argparse.SUPPRESS)
    return ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                          **kwargs)
