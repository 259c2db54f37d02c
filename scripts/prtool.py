#!/usr/bin/env python3
"""Upstream-PR helpers for scripts/upstream-pr.sh (no vLLM needed).

  prtool.py needs --root DIR PATCH      overlay files PATCH needs, one a line
  prtool.py message PATCH               the commit message, fork-only trailers
                                        (Upstream-Status, Drop-When, Fork-Test)
                                        removed; Signed-off-by, Link, ... kept
  prtool.py body PATCH --template T [--new-file F]... [--checked TEXT]...
                                        the PR description in T's sections

"Needs" is the closure over references: module names (imports and the
dotted strings connector registries use) and source paths in the patch's
added lines; then, inside each overlay file found, its imports (absolute
and relative), dotted-module strings, `csrc/...` paths and `#include "..."`.
A module maps to an overlay file when overlay/<a/b/c>.py or
overlay/<a/b/c>/__init__.py exists; the __init__.py of every overlay
package on the way is included too.
"""

from __future__ import annotations

import ast
import re
import sys
from email.parser import HeaderParser
from pathlib import Path

import scriptlib  # scripts/: one-line usage errors

FORK_ONLY_TRAILERS = ("Upstream-Status", "Drop-When", "Fork-Test")
DOTTED_RE = re.compile(r"\bvllm(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH_RE = re.compile(r"\b(?:csrc|vllm)/[A-Za-z0-9_/.-]+\.(?:py|cmake|cu|cuh|cpp|h|txt)\b")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def overlay_set(root: Path) -> set[str]:
    base = root / "overlay"
    return {p.relative_to(base).as_posix() for p in base.rglob("*")
            if p.is_file() and p.name != "MANIFEST" and "__pycache__" not in p.parts}


def module_files(dotted: str, overlay: set[str]) -> list[str]:
    """Overlay files for the longest prefix of `dotted` that is an overlay module."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        stem = "/".join(parts[:n])
        for cand in (f"{stem}.py", f"{stem}/__init__.py"):
            if cand in overlay:
                return [cand] + package_inits(cand, overlay)
    return []


def package_inits(path: str, overlay: set[str]) -> list[str]:
    out, parts = [], path.split("/")[:-1]
    for n in range(len(parts), 0, -1):
        init = "/".join(parts[:n]) + "/__init__.py"
        if init in overlay and init != path:
            out.append(init)
    return out


def refs_in_text(text: str, overlay: set[str]) -> set[str]:
    found: set[str] = set()
    for dotted in DOTTED_RE.findall(text):
        found.update(module_files(dotted, overlay))
    for path in PATH_RE.findall(text):
        if path in overlay:
            found.add(path)
            found.update(package_inits(path, overlay))
    return found


def refs_in_python(path: str, source: str, overlay: set[str]) -> set[str]:
    found = refs_in_text(source, overlay)
    pkg = path.split("/")[:-1] if not path.endswith("__init__.py") else path.split("/")[:-1]
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.update(module_files(a.name, overlay))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.update(module_files(mod, overlay))
            for a in node.names:  # `from pkg import module`
                found.update(module_files(f"{mod}.{a.name}", overlay))
    return found


def needs(root: Path, patch: Path) -> list[str]:
    overlay = overlay_set(root)
    added = "\n".join(ln[1:] for ln in patch.read_text().splitlines()
                      if ln.startswith("+") and not ln.startswith("+++"))
    todo = sorted(refs_in_text(added, overlay))
    seen: set[str] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        text = (root / "overlay" / f).read_text(errors="replace")
        if f.endswith(".py"):
            more = refs_in_python(f, text, overlay)
        else:
            more = refs_in_text(text, overlay)
            folder = f.rsplit("/", 1)[0]
            for inc in INCLUDE_RE.findall(text):
                cand = f"{folder}/{inc}"
                if cand in overlay:
                    more.add(cand)
        todo.extend(sorted(more - seen))
    return sorted(seen)


def split_message(patch: Path) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(subject, body paragraphs, trailers) of a format-patch file."""
    text = patch.read_text()
    headers = HeaderParser().parsestr(text, headersonly=True)
    subject = " ".join(headers["Subject"].split())
    rest = text.split("\n\n", 1)[1]
    cut = rest.find("\ndiff --git ")
    body = rest if cut < 0 else rest[:cut]
    paras = [p.strip("\n") for p in body.strip().split("\n\n") if p.strip()]
    trailers: list[tuple[str, str]] = []
    if paras and all(re.match(r"^[A-Za-z][A-Za-z0-9-]*: ", ln) for ln in paras[-1].splitlines()):
        trailers = [tuple(ln.split(": ", 1)) for ln in paras.pop().splitlines()]
    return subject, paras, trailers


def message(patch: Path) -> str:
    subject, paras, trailers = split_message(patch)
    kept = [f"{k}: {v}" for k, v in trailers if k not in FORK_ONLY_TRAILERS]
    out = [subject, ""] + ["\n\n".join(paras)]
    if kept:
        out += ["", "\n".join(kept)]
    return "\n".join(out).rstrip() + "\n"


def section(paras: list[str], label: str) -> str:
    """The text of the 'Label:' paragraph(s) up to the next 'X:' label."""
    joined = "\n\n".join(paras)
    m = re.search(rf"(?ms)^{label}:\s*(.*?)(?=^\s*(?:Why|What|Risk|Tested by):|\Z)", joined)
    return m.group(1).strip() if m else ""


def body(patch: Path, template: Path, new_files: list[str], checked: list[str]) -> str:
    subject, paras, trailers = split_message(patch)
    tmpl = template.read_text()
    tested = section(paras, "Tested by")
    purpose = [p for p in paras if not p.startswith("Tested by:")]
    fork_test = dict(trailers).get("Fork-Test", "")
    if new_files:
        purpose += ["New files in this PR:\n\n" + "\n".join(f"- `{f}`" for f in new_files)]
    purpose = ["\n\n".join(purpose)]
    plan = [tested or "(describe)"]
    if fork_test and fork_test != "none":
        plan += ["", "Commands:", "", "```", f"pytest {fork_test}", "```"]
    result = ["Checked when this branch was prepared:", ""] + [f"- {c}" for c in checked]
    result += ["", "(Paste the Test Plan's results here before submitting.)"]
    filled = {"Purpose": "\n".join(purpose), "Test Plan": "\n".join(plan), "Test Result": "\n".join(result)}
    out = tmpl
    for head, text in filled.items():
        marker = f"## {head}\n"
        if marker not in out:
            sys.exit(f"prtool: the template has no '## {head}' section")
        out = out.replace(marker, f"{marker}\n{text}\n", 1)
    return out


def main() -> None:
    ap = scriptlib.doc_parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("needs")
    n.add_argument("--root", type=Path, required=True)
    n.add_argument("patch", type=Path)
    m = sub.add_parser("message")
    m.add_argument("patch", type=Path)
    b = sub.add_parser("body")
    b.add_argument("patch", type=Path)
    b.add_argument("--template", type=Path, required=True)
    b.add_argument("--new-file", action="append", default=[])
    b.add_argument("--checked", action="append", default=[])
    args = ap.parse_args()
    if args.cmd == "needs":
        print("\n".join(needs(args.root, args.patch)))
    elif args.cmd == "message":
        sys.stdout.write(message(args.patch))
    else:
        sys.stdout.write(body(args.patch, args.template, args.new_file, args.checked))


if __name__ == "__main__":
    main()
