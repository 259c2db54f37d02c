#!/usr/bin/env python3
"""The report of scripts/rebase.sh (summary.md + summary.json).

  rebasetool.py report --root DIR --target VER --old TREE --new TREE
                       --apply TSV --collisions TXT --range-diff TXT
                       --sdist-sha256 HEX --sdist-url URL --new-commit ID --out DIR

Everything is computed from the inputs at run time: the series and
overlay/MANIFEST of DIR, the two generated trees (old: current pin + series;
new: target pin + overlay + what applied) and git range-diff's summary.

Per patch: `unchanged` (applies with plain git am and range-diff says '='),
`needed work` (applied only with git am -3, or its diff changed: '!'),
`conflict` (does not apply even with -3; left out of the new range).
Unmatched range-diff entries ('<' without '=' or '!') are listed with the
commit they could pair with and an explicit interdiff, since range-diff
shows no content for them.

Seams: for every hunk of every patch, the upstream definition it sits in
(innermost def/class of the old pin's file around the hunk's pre-image) and
whether that definition's source is the same at the target.

Collisions: overlay files that exist at the target; overlay packages
(folders) that exist there, with the upstream files inside; connector names
our patches register that the target registers too; config fields our
patches add to upstream config classes that the target already has; classes
defined in our colliding overlay files that the target defines too (and the
fields of same-named config classes).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import scriptlib  # scripts/: one-line usage errors

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
RANGE_RE = re.compile(r"^\s*(\d+|-):\s+([0-9a-f]+|-+) ([=!<>]) \s*(\d+|-):\s+([0-9a-f]+|-+) (.*)$")
REGISTER_RE = re.compile(r"register_connector\(\s*[\"']([^\"']+)[\"']")


def git(tree: Path, *args: str, check: bool = True) -> str:
    res = subprocess.run(["git", "-C", str(tree), "-c", "core.abbrev=12", *args],
                         capture_output=True, text=True)
    if check and res.returncode != 0:
        sys.exit(f"rebasetool: git {' '.join(args)} failed: {res.stderr.strip()}")
    return res.stdout if res.returncode == 0 else ""


def show(tree: Path, ref: str, path: str) -> str | None:
    res = subprocess.run(["git", "-C", str(tree), "show", f"{ref}:{path}"],
                         capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def series(root: Path) -> list[str]:
    return [ln.strip() for ln in (root / "patches/series").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def manifest(root: Path) -> list[str]:
    return [ln.split(None, 1)[1] for ln in (root / "overlay/MANIFEST").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def subject(patch: Path) -> str:
    from email.parser import HeaderParser
    return " ".join(HeaderParser().parsestr(patch.read_text(), headersonly=True)["Subject"].split())


def hunks(patch: Path) -> list[tuple[str, int, int, list[str]]]:
    """(file, old start, old count, added lines) per hunk."""
    out, cur, h = [], None, None
    for ln in patch.read_text().splitlines():
        if ln.startswith("diff --git "):
            cur = ln.split(" b/", 1)[1]
            h = None
        elif (m := HUNK_RE.match(ln)) and cur:
            h = [cur, int(m[1]), int(m[2] or 1), []]
            out.append(h)
        elif h is not None and ln.startswith("+") and not ln.startswith("+++"):
            h[3].append(ln[1:])
    return [tuple(x) for x in out]


# --- python definitions ----------------------------------------------------

def definitions(source: str) -> dict[str, tuple[int, int, str, str]]:
    """qualified name -> (first line, last line, source, 'class'|'def')."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    lines = source.splitlines()
    out: dict[str, tuple[int, int, str, str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                out[name] = (start, child.end_lineno, "\n".join(lines[start - 1:child.end_lineno]), kind)
                visit(child, name + ".")
    visit(tree, "")
    return out


def enclosing(defs: dict[str, tuple[int, int, str, str]], first: int, last: int) -> str | None:
    best = None
    for name, (a, b, _, _) in defs.items():
        if a <= first and last <= b and (best is None or (b - a) < (defs[best][1] - defs[best][0])):
            best = name
    return best


def class_fields(source: str, cls: str) -> dict[str, str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {st.target.id: ast.unparse(st.annotation) for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    return {}


def top_level_classes(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, ast.ClassDef)]


# --- report parts ----------------------------------------------------------

def seams(root: Path, old: Path, new: Path, names: list[str]) -> list[dict]:
    out = []
    for name in names:
        for path, start, count, _added in hunks(root / f"patches/{name}.patch"):
            old_src = show(old, "refs/patches/upstream-head", path)
            new_src = show(new, "refs/patches/upstream-head", path)
            row = {"patch": name, "file": path, "old_line": start}
            if old_src is None:
                row.update(anchor="(new file)", status="new file")
            elif new_src is None:
                row.update(anchor="(file)", status="file missing at target")
            elif path.endswith(".py"):
                od, nd = definitions(old_src), definitions(new_src)
                anchor = enclosing(od, start, start + max(count, 1) - 1)
                ctx = old_src.splitlines()[start - 1:start - 1 + count]
                if anchor is None or od[anchor][3] == "class":
                    # module level or a class body: the hunk's own context
                    where = f"module level, line {start}" if anchor is None else f"{anchor} (class body)"
                    row.update(anchor=where, status="context same" if has_block(new_src, ctx) else "context changed")
                elif anchor not in nd:
                    row.update(anchor=anchor, status="missing at target")
                else:
                    same = od[anchor][2] == nd[anchor][2]
                    row.update(anchor=anchor, status="same" if same else "changed",
                               new_line=nd[anchor][0])
            else:
                ctx = old_src.splitlines()[start - 1:start - 1 + count]
                row.update(anchor=f"lines {start}-{start + count - 1}",
                           status="context same" if has_block(new_src, ctx) else "context changed")
            out.append(row)
    return out


def has_block(text: str, block: list[str]) -> bool:
    """`block` occurs in `text` as whole consecutive lines."""
    lines, n = text.splitlines(), len(block)
    return any(lines[i:i + n] == block for i in range(len(lines) - n + 1))


def parse_range_diff(text: str) -> list[dict]:
    rows = []
    for ln in text.splitlines():
        m = RANGE_RE.match(ln)
        if m:
            rows.append({"old_n": m[1], "old": m[2], "op": m[3], "new_n": m[4], "new": m[5], "subject": m[6].strip()})
    return rows


def collisions(root: Path, old: Path, new: Path, exact: list[str], names: list[str]) -> dict:
    files = manifest(root)
    # The folders the overlay creates (absent at the current pin): our own
    # namespaces. One that exists at the target collides as a whole.
    dirs = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f})
    pkgs = [d for d in dirs
            if not git(old, "ls-tree", "--name-only", "refs/patches/upstream-head", f"{d}/", check=False).strip()]
    packages = []
    for d in pkgs:
        listing = git(new, "ls-tree", "--name-only", "refs/patches/upstream-head", f"{d}/", check=False).split()
        if listing:
            ours = {f for f in files if f.startswith(d + "/") and "/" not in f[len(d) + 1:]}
            packages.append({"package": d, "upstream_files": listing,
                             "same_name": sorted(ours & set(listing)),
                             "upstream_only": sorted(set(listing) - ours),
                             "ours_only": sorted(ours - set(listing))})
    # classes both sides define in colliding files
    classes = []
    for f in exact:
        if not f.endswith(".py"):
            continue
        ours = top_level_classes((root / "overlay" / f).read_text())
        theirs = top_level_classes(show(new, "refs/patches/upstream-head", f) or "")
        both = sorted(set(ours) & set(theirs))
        classes.append({"file": f, "both": both, "ours_only": sorted(set(ours) - set(theirs)),
                        "upstream_only": sorted(set(theirs) - set(ours))})
    # connector names
    connectors = []
    added = "\n".join(a for n in names for _, _, _, adds in hunks(root / f"patches/{n}.patch") for a in adds)
    upstream_names: dict[str, list[str]] = {}
    for hit in git(new, "grep", "-l", "register_connector(", "refs/patches/upstream-head", "--", "vllm",
                   check=False).split():
        path = hit.split(":", 1)[1]
        src = show(new, "refs/patches/upstream-head", path) or ""
        for m in REGISTER_RE.finditer(src):
            upstream_names.setdefault(m[1], []).append(f"{path}:{src.count(chr(10), 0, m.start()) + 1}")
    for cname in sorted(set(REGISTER_RE.findall(added))):
        connectors.append({"name": cname, "upstream": upstream_names.get(cname, [])})
    # config fields our patches add to upstream classes (old pin vs old top)
    config = []
    for n in names:
        for path in sorted({h[0] for h in hunks(root / f"patches/{n}.patch")}):
            if not (path.startswith("vllm/config/") and path.endswith(".py")):
                continue
            before = show(old, "refs/patches/upstream-head", path) or ""
            after = show(old, "refs/patches/top", path) or ""
            target = show(new, "refs/patches/upstream-head", path) or ""
            for cls in top_level_classes(after):
                fb, fa, ft = class_fields(before, cls), class_fields(after, cls), class_fields(target, cls)
                for field in sorted(set(fa) - set(fb)):
                    config.append({"patch": n, "file": path, "class": cls, "field": field,
                                   "ours": fa[field], "upstream": ft.get(field)})
    # same-named config classes: field sets side by side
    config_classes = []
    for f in files:
        if not (f.startswith("vllm/config/") and f.endswith(".py")):
            continue
        for cls in top_level_classes((root / "overlay" / f).read_text()):
            hits = git(new, "grep", "-l", "-E", rf"^class {cls}\b", "refs/patches/upstream-head", "--", "vllm",
                       check=False).split()
            for h in hits:
                upath = h.split(":", 1)[1]
                ours = class_fields((root / "overlay" / f).read_text(), cls)
                theirs = class_fields(show(new, "refs/patches/upstream-head", upath) or "", cls)
                config_classes.append({"class": cls, "ours": f, "upstream": upath,
                                       "fields_both": sorted(set(ours) & set(theirs)),
                                       "fields_ours_only": sorted(set(ours) - set(theirs)),
                                       "fields_upstream_only": sorted(set(theirs) - set(ours))})
    # native names: torch op namespaces of the overlay's sources, extension
    # modules and CMake targets our patches and overlay declare
    native_names: set[str] = set()
    for f in files:
        if f.startswith("csrc/"):
            text = (root / "overlay" / f).read_text(errors="replace")
            native_names.update(re.findall(r"\b(?:STABLE_)?TORCH_LIBRARY(?:_FRAGMENT)?\(\s*(\w+)", text))
            native_names.update(re.findall(r"define_extension_target\(\s*(\w+)", text))
    native_names.update(re.findall(r"CMakeExtension\(name=\"([\w.]+)\"", added))
    native = []
    for nm in sorted(native_names):
        hits = git(new, "grep", "-n", "-w", "-F", nm, "refs/patches/upstream-head", "--", "csrc", "CMakeLists.txt",
                   "setup.py", "vllm", check=False).strip().splitlines()
        native.append({"name": nm, "upstream": [h.split(":", 1)[1] for h in hits][:5]})
    return {"files": exact, "packages": packages, "classes": classes, "connectors": connectors,
            "config_fields": config, "config_classes": config_classes, "native": native}


def interdiff(old: Path, new: Path, a: str, b: str) -> str:
    import difflib
    pa = git(old, "show", "--format=%s%n", a).splitlines()
    pb = git(new, "show", "--format=%s%n", b).splitlines()
    strip = lambda ls: [re.sub(r"^(index [0-9a-f]+\.\.[0-9a-f]+|@@ -\d+(,\d+)? \+\d+(,\d+)? @@)", r"\1", x) for x in ls]
    return "\n".join(difflib.unified_diff(strip(pa), strip(pb), "old", "new", lineterm="", n=2))


def report(args: argparse.Namespace) -> None:
    root, old, new = args.root, args.old, args.new
    names = series(root)
    applied = {}
    for ln in args.apply.read_text().splitlines():
        parts = ln.split("\t")
        applied[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    rd = parse_range_diff(args.range_diff.read_text())
    subj = {n: subject(root / f"patches/{n}.patch") for n in names}
    by_subject: dict[str, list[dict]] = {}
    for r in rd:
        by_subject.setdefault(r["subject"], []).append(r)
    patches = []
    for n in names:
        how, files = applied.get(n, ("missing", ""))
        rows = by_subject.get(subj[n], [])
        ops = "".join(r["op"] for r in rows)
        if how == "conflict":
            cat = "conflict"
        elif "=" in ops and how == "clean":
            cat = "unchanged"
        elif "=" in ops or "!" in ops:
            cat = "needed work"
        else:
            cat = "unmatched"
        patches.append({"patch": n, "subject": subj[n], "git_am": how, "range_diff": ops or "?",
                        "category": cat, "conflict_files": files.split() if files else []})
    # unmatched range-diff entries and their possible partners
    unmatched = []
    olds = [r for r in rd if r["op"] == "<"]
    news = [r for r in rd if r["op"] == ">"]
    for r in olds:
        partner = next((x for x in news if x["subject"] == r["subject"]), None)
        entry = {"old": r["old"], "subject": r["subject"], "new": partner["new"] if partner else None}
        p = next((x for x in patches if x["subject"] == r["subject"]), None)
        if p and p["category"] == "conflict":
            entry["why"] = "conflict: not applied at the target"
        elif partner:
            entry["why"] = "applied, but range-diff could not pair it (diff changed too much)"
            entry["interdiff"] = interdiff(old, new, r["old"], partner["new"])
        else:
            entry["why"] = "no commit with this subject at the target"
        unmatched.append(entry)
    for r in news:
        if not any(u.get("new") == r["new"] for u in unmatched):
            unmatched.append({"old": None, "new": r["new"], "subject": r["subject"],
                              "why": "only at the target"})
    seam_rows = seams(root, old, new, names)
    coll = collisions(root, old, new,
                      [ln for ln in args.collisions.read_text().splitlines() if ln.strip()], names)
    repo_commit = git(root, "rev-parse", "--short=12", "HEAD", check=False).strip() or "unknown"
    dirty = bool(git(root, "status", "--porcelain", "--", "patches", "overlay", "scripts", check=False).strip())
    data = {"target": args.target, "pin": re.search(r"^VLLM_VERSION=(.*)$", (root / "UPSTREAM").read_text(), re.M)[1],
            "sdist_sha256": args.sdist_sha256, "sdist_url": args.sdist_url, "target_commit": args.new_commit,
            "generated_at": repo_commit + ("-dirty" if dirty else ""),
            "overlay_files": len(manifest(root)), "patches": patches, "unmatched": unmatched,
            "seams": seam_rows, "collisions": coll}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "summary.md").write_text(render(data))


def render(d: dict) -> str:
    P = d["patches"]
    count = lambda c: sum(1 for p in P if p["category"] == c)
    changed_seams = [s for s in d["seams"] if s["status"] not in ("same", "context same", "new file")]
    c = d["collisions"]
    L = [f"# Series {d['pin']} -> vLLM {d['target']}: rebase report", "",
         f"Generated by `scripts/rebase.sh {d['target']}` at series commit {d['generated_at']} "
         f"({len(P)} patches, {d['overlay_files']} overlay files); the pin did not move.",
         f"Target: PyPI sdist vllm-{d['target']}.tar.gz, sha256 {d['sdist_sha256']} "
         f"(upstream commit {d['target_commit']}).", "",
         "## Headline", "",
         f"- patches: {count('unchanged')} unchanged, {count('needed work')} needed work, "
         f"{count('conflict')} conflict, {count('unmatched')} unmatched; range-diff entries without a "
         f"partner: {len(d['unmatched'])} (listed below)",
         f"- seams: {sum(1 for s in d['seams'] if s['status'] in ('same', 'context same'))} of "
         f"{len([s for s in d['seams'] if s['status'] != 'new file'])} hunk anchors unchanged"
         + (f"; changed: {', '.join(sorted({s['anchor'] + ' (' + s['file'] + ')' for s in changed_seams}))}" if changed_seams else ""),
         f"- collisions: {len(c['files'])} overlay files, {len(c['packages'])} overlay packages, "
         f"{sum(1 for x in c['connectors'] if x['upstream'])} connector names, "
         f"{sum(1 for x in c['config_fields'] if x['upstream'])} config fields, "
         f"{sum(1 for x in c.get('native', []) if x['upstream'])} native names, "
         f"{sum(len(x['both']) for x in c['classes'])} classes in colliding files",
         "", "## Patches", "",
         "| patch | git am | range-diff | result |", "|---|---|---|---|"]
    for p in P:
        extra = f" ({', '.join(p['conflict_files'])})" if p["conflict_files"] else ""
        L.append(f"| {p['patch']} | {p['git_am']} | {p['range_diff']} | {p['category']}{extra} |")
    L += ["", "`clean`: plain `git am`; `3way`: only with `git am -3`; range-diff `=` same diff, "
          "`!` diff changed, `<` not at the target.", "", "## Unmatched range-diff entries", ""]
    if not d["unmatched"]:
        L.append("None: every commit of the old range pairs with one of the new range.")
    for u in d["unmatched"]:
        L.append(f"- old {u['old'] or '-'} / new {u['new'] or '-'}: {u['subject']}: {u['why']}")
        if u.get("interdiff"):
            L += ["", "```diff", u["interdiff"], "```", ""]
    L += ["", "## Seams (upstream code each hunk sits in)", "",
          "| patch | file | anchor | at the target |", "|---|---|---|---|"]
    for s in d["seams"]:
        L.append(f"| {s['patch']} | {s['file']} | {s['anchor']} | {s['status']} |")
    L += ["", "## Collisions", "", f"### Overlay files that exist at {d['target']} ({len(c['files'])})", ""]
    L += [f"- `{f}`" for f in c["files"]] or ["None."]
    L += ["", f"### Overlay packages that exist at {d['target']} ({len(c['packages'])})", ""]
    for p in c["packages"]:
        L.append(f"- `{p['package']}/`: same names {p['same_name'] or '-'}; upstream only "
                 f"{p['upstream_only'] or '-'}; ours only {p['ours_only'] or '-'}")
    if not c["packages"]:
        L.append("None.")
    L += ["", "### Classes defined on both sides of a colliding file", ""]
    rows = [x for x in c["classes"] if x["both"]]
    L += [f"- `{x['file']}`: {', '.join(x['both'])}" for x in rows] or ["None."]
    L += ["", "### Connector names our patches register", ""]
    for x in c["connectors"]:
        L.append(f"- `{x['name']}`: " + (f"registered at {d['target']} too ({'; '.join(x['upstream'])})" if x["upstream"] else "free"))
    L += ["", "### Native names (torch op namespaces, extension modules, CMake targets)", ""]
    for x in c.get("native", []):
        L.append(f"- `{x['name']}`: " + (f"used at {d['target']} ({'; '.join(x['upstream'])})" if x["upstream"] else "free"))
    L += ["", "### Config fields our patches add to upstream classes", ""]
    for x in c["config_fields"]:
        L.append(f"- `{x['class']}.{x['field']}` ({x['file']}, {x['patch']}): ours `{x['ours']}`; "
                 + (f"**{d['target']} has it** as `{x['upstream']}`" if x["upstream"] else "free"))
    L += ["", "### Same-named config classes", ""]
    for x in c["config_classes"]:
        L.append(f"- `{x['class']}`: ours {x['ours']}, upstream {x['upstream']}; fields on both sides "
                 f"{x['fields_both'] or '-'}; ours only {x['fields_ours_only'] or '-'}; upstream only "
                 f"{x['fields_upstream_only'] or '-'}")
    if not c["config_classes"]:
        L.append("None.")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = scriptlib.doc_parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    for a in ("root", "old", "new", "apply", "collisions", "range-diff", "out"):
        r.add_argument(f"--{a}", type=Path, required=True)
    for a in ("target", "sdist-sha256", "sdist-url", "new-commit"):
        r.add_argument(f"--{a}", required=True)
    args = ap.parse_args()
    report(args)


if __name__ == "__main__":
    main()
