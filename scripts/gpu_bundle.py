#!/usr/bin/env python3
"""Helpers of the GPU bundle (scripts/bundle.sh, scripts/test-gpu.sh).

The lent GPU machine has python 3.12, torch 2.11.0+cu130 and no network, so
the patched vLLM travels there as .tar.xz parts (docs/workflow.md "GPU
bundle"). Subcommands:

  deps-resolve  regenerate scripts/gpu-bundle/deps.txt: the closure of the
                pinned wheel's Requires-Dist (extras followed), less what the
                GPU image has (image-packages.txt) and what is excluded
                (excluded.txt), at the versions of vLLM's requirements/test/
                cuda.txt lock where it pins them. Needs PyPI (pip download).
  deps-check    offline: every requirement of vLLM and of each shipped wheel
                is shipped (at a version that satisfies it), in the image or
                excluded. bundle.sh runs it on every base build.
  precompiled   extract from the vLLM wheel what its precompiled mode takes
                (vLLM 0.26.0 setup.py), less the excluded members, pruning the
                fat binaries to one architecture.
  pack          deterministic .tar.xz parts of at most N MiB each.
  verify        check parts against bundle.json (sizes, sha256, limit).
  env-check     on the GPU host: vLLM's requirements against what imports.

Standard library only (plus pip's vendored `packaging` when `packaging` is
not installed), so the machine's or the developer's python3 runs it.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import scriptlib  # scripts/: one-line usage errors

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover - every pip carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

HERE = Path(__file__).resolve().parent
CONF = HERE / "gpu-bundle"
MIB = 1 << 20
# The GPU host: CPython 3.12 on x86-64 Linux (glibc >= 2.28 like the wheel).
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "platform_machine": "x86_64", "platform_system": "Linux",
    "sys_platform": "linux", "os_name": "posix",
}
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12",
                "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                "--abi", "none"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux_2_5_x86_64",
                "manylinux1_x86_64", "any")
    for a in ("--platform", p)]
# Fixed metadata in every archive member: same inputs, same bytes.
TAR_MTIME = 1767225600  # 2026-01-01T00:00:00Z


def cn(name: str) -> str:
    return canonicalize_name(name)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def die(msg: str) -> None:
    print(f"[gpu_bundle] error: {msg}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------
# Configuration files (scripts/gpu-bundle/)
# ---------------------------------------------------------------------------

def config_lines(path: Path, trailing_comments: bool = True) -> list[str]:
    """The stripped, non-blank lines of a config file, '#' lines left out;
    with ``trailing_comments`` also everything after a '#'."""
    out = []
    for ln in path.read_text().splitlines():
        ln = ln.split("#", 1)[0] if trailing_comments else ln
        ln = ln.strip()
        if ln and not ln.startswith("#"):
            out.append(ln)
    return out


def read_names(path: Path) -> set[str]:
    """image-packages.txt: one distribution name a line, '#' comments."""
    return {cn(ln) for ln in config_lines(path)}


def read_reasons(path: Path) -> list[tuple[str, str]]:
    """`KEY  reason...` lines; the reason is mandatory (and may itself hold
    a '#')."""
    out = []
    for ln in config_lines(path, trailing_comments=False):
        key, _, reason = ln.partition(" ")
        if not reason.strip():
            die(f"{path}: '{key}' has no reason")
        out.append((key, reason.strip()))
    return out


def read_excluded(path: Path) -> dict[str, str]:
    """excluded.txt: `name  reason...`."""
    return {cn(name): reason for name, reason in read_reasons(path)}


def read_deps(path: Path) -> dict[str, str]:
    """deps.txt: `name==version  # via ...`."""
    out = {}
    for ln in config_lines(path):
        name, sep, ver = ln.partition("==")
        if not sep:
            die(f"{path}: '{ln}' is not name==version")
        out[cn(name)] = ver.strip()
    return out


def read_lock(path: Path) -> dict[str, str]:
    """name -> version of a uv/pip-compile lock (requirements/test/cuda.txt)."""
    pins = {}
    for ln in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)(?:\[[^\]]*\])?==([^\s;]+)", ln)
        if m:
            pins[cn(m.group(1))] = m.group(2)
    return pins


# ---------------------------------------------------------------------------
# Wheels and their metadata
# ---------------------------------------------------------------------------

def wheel_name_version(path: Path) -> tuple[str, str]:
    parts = path.name[:-4].split("-")
    return cn(parts[0]), parts[1]


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if n.count("/") == 1 and n.endswith(".dist-info/METADATA"):
                return z.read(n).decode("utf-8", "replace")
    die(f"{path} has no .dist-info/METADATA")
    return ""


def requires_dist(metadata: str) -> list[Requirement]:
    out = []
    for ln in metadata.splitlines():
        if ln.startswith("Requires-Dist:"):
            out.append(Requirement(ln.split(":", 1)[1].strip()))
        elif not ln.strip():
            break  # end of the headers
    return out


def active_requirements(metadata: str, extras: set[str]) -> list[Requirement]:
    reqs = []
    for r in requires_dist(metadata):
        if r.marker is None:
            reqs.append(r)
            continue
        envs = [{**MARKER_ENV, "extra": e} for e in (sorted(extras) + [""])]
        if any(r.marker.evaluate(env) for env in envs):
            reqs.append(r)
    return reqs


def find_wheel(cache: Path, name: str, version: str | None) -> Path | None:
    for w in sorted(cache.glob("*.whl")):
        n, v = wheel_name_version(w)
        if n == name and (version is None or Version(v) == Version(version)):
            return w
    return None


def pip_download(cache: Path, specs: list[str]) -> None:
    if not specs:
        return
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
           *PIP_PLATFORM, "-d", str(cache), *specs]
    print("+ pip download --no-deps ... " + " ".join(specs), file=sys.stderr)
    subprocess.run(cmd, check=True)


# ---------------------------------------------------------------------------
# deps-resolve / deps-check
# ---------------------------------------------------------------------------

def cmd_deps_resolve(a: argparse.Namespace) -> None:
    image = read_names(a.image)
    excluded = read_excluded(a.excluded)
    lock = read_lock(a.lock)
    cache = a.cache
    vllm_meta = wheel_metadata(a.wheel)
    chosen: dict[str, str] = {}
    extras: dict[str, set[str]] = {}
    via: dict[str, str] = {}
    expanded: dict[str, frozenset] = {}
    frontier = [(r, "vllm") for r in active_requirements(vllm_meta, set())]
    while frontier:
        todo: dict[str, Requirement] = {}
        for req, parent in frontier:
            name = cn(req.name)
            if name in image or name in excluded or name == "vllm":
                continue
            extras.setdefault(name, set()).update(req.extras)
            via.setdefault(name, parent)
            if name not in chosen:
                todo[name] = req
        specs = []
        for name, req in todo.items():
            pin = lock.get(name)
            if pin and req.specifier.contains(pin, prereleases=True):
                chosen[name] = pin
            else:
                chosen[name] = ""  # pip picks; recorded below
            if find_wheel(cache, name, chosen[name] or None) is None:
                specs.append(f"{req.name}=={pin}" if chosen[name] else
                             f"{req.name}{req.specifier}")
        pip_download(cache, specs)
        frontier = []
        for name in sorted(chosen):
            w = find_wheel(cache, name, chosen[name] or None)
            if w is None:
                die(f"no cp312/manylinux wheel of {name} {chosen[name]} downloaded")
            chosen[name] = wheel_name_version(w)[1]
            key = frozenset(extras.get(name, set()))
            if expanded.get(name) == key:
                continue
            expanded[name] = key
            for r in active_requirements(wheel_metadata(w), set(key)):
                frontier.append((r, name))
    lines = ["# Dependencies of the GPU bundle's base part (scripts/bundle.sh): the",
             "# closure of the pinned vLLM wheel's Requires-Dist, less the GPU image's",
             "# packages (image-packages.txt) and excluded.txt; versions from vLLM",
             "# 0.26.0's requirements/test/cuda.txt lock where it pins them.",
             "# Generated by: scripts/gpu_bundle.py deps-resolve (do not edit by hand).",
             ""]
    for name in sorted(chosen):
        src = "lock" if lock.get(name) == chosen[name] else "latest"
        ex = f"; extras {','.join(sorted(extras[name]))}" if extras.get(name) else ""
        lines.append(f"{name}=={chosen[name]}  # via {via[name]}{ex}; {src}")
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}: {len(chosen)} packages", file=sys.stderr)


def closure_errors(wheel: Path, deps: dict[str, str], image: set[str],
                   excluded: dict[str, str], cache: Path) -> list[str]:
    errors = []
    wheels = {}
    for name, ver in deps.items():
        w = find_wheel(cache, name, ver)
        if w is None:
            errors.append(f"{name}=={ver}: wheel not in {cache}")
        else:
            wheels[name] = w
    shipped_extras: dict[str, set[str]] = {n: set() for n in deps}
    edges = [("vllm", r) for r in active_requirements(wheel_metadata(wheel), set())]
    seen = set()
    while edges:
        parent, req = edges.pop()
        name = cn(req.name)
        if name in image or name in excluded:
            continue
        if name not in deps:
            errors.append(f"{parent} requires {req} which is neither shipped "
                          "(deps.txt), in the image nor excluded")
            continue
        if not req.specifier.contains(deps[name], prereleases=True):
            errors.append(f"{parent} requires {req} but deps.txt ships "
                          f"{name}=={deps[name]}")
        shipped_extras[name].update(req.extras)
        key = (name, frozenset(shipped_extras[name]))
        if key in seen or name not in wheels:
            continue
        seen.add(key)
        for r in active_requirements(wheel_metadata(wheels[name]),
                                     shipped_extras[name]):
            edges.append((name, r))
    reached = {k[0] for k in seen}
    for name in sorted(set(deps) - reached):
        errors.append(f"{name}=={deps[name]} is shipped but nothing requires it")
    return errors


def cmd_deps_fetch(a: argparse.Namespace) -> None:
    """Download the deps.txt wheels that the cache lacks (pip, --no-deps)."""
    deps = read_deps(a.deps)
    missing = [f"{n}=={v}" for n, v in sorted(deps.items())
               if find_wheel(a.cache, n, v) is None]
    if missing:
        print(f"deps: downloading {len(missing)} wheel(s) into {a.cache}",
              file=sys.stderr)
        pip_download(a.cache, missing)
    still = [f"{n}=={v}" for n, v in sorted(deps.items())
             if find_wheel(a.cache, n, v) is None]
    if still:
        die(f"no cp312/manylinux wheel for: {' '.join(still)}")


def cmd_deps_check(a: argparse.Namespace) -> None:
    errors = closure_errors(a.wheel, read_deps(a.deps), read_names(a.image),
                            read_excluded(a.excluded), a.cache)
    for e in errors:
        print(f"[gpu_bundle] deps: {e}", file=sys.stderr)
    if errors:
        die(f"{len(errors)} dependency problem(s); regenerate with "
            "scripts/gpu_bundle.py deps-resolve (see docs/workflow.md)")
    print("deps: closure complete", file=sys.stderr)


# ---------------------------------------------------------------------------
# site: the dependency wheels unpacked, trimmed, plus the stand-ins
# ---------------------------------------------------------------------------

# Test-bundle stand-ins (never for a release bundle), as in the prototype GPU
# recipe: vLLM evaluates llguidance/xgrammar classes in annotations at import,
# and vllm_flash_attn refuses to import without an FA extension although the
# FLASHMLA_SPARSE path never calls it. path -> content; "site/" paths go on
# sys.path, "vllm/" paths into the vllm package.
STAND_INS = {
    "site/llguidance/__init__.py":
        "# test-bundle stand-in (scripts/gpu_bundle.py): only the names vLLM\n"
        "# evaluates in annotations at import; llguidance itself is not shipped.\n"
        "class LLMatcher: pass\nclass LLTokenizer: pass\nclass LLInterpreter: pass\n",
    "site/llguidance/hf.py": "# test-bundle stand-in (scripts/gpu_bundle.py)\n",
    "site/llguidance/torch.py": "# test-bundle stand-in (scripts/gpu_bundle.py)\n",
    "site/xgrammar/__init__.py":
        "# test-bundle stand-in (scripts/gpu_bundle.py): only the names vLLM\n"
        "# evaluates in annotations at import; xgrammar itself is not shipped.\n"
        "class GrammarMatcher: pass\nclass CompiledGrammar: pass\n",
    "vllm/vllm_flash_attn/_vllm_fa2_C.py":
        "# test-bundle stand-in (scripts/gpu_bundle.py): vllm_flash_attn/__init__\n"
        "# raises unless an FA extension imports; the FLASHMLA_SPARSE path never\n"
        "# calls FlashAttention, whose 436 MB of kernels the bundle leaves out.\n",
}


def read_trim(path: Path) -> list[tuple[str, str]]:
    """trim.txt: `GLOB  reason...`."""
    return read_reasons(path)


def cmd_site(a: argparse.Namespace) -> None:
    """Unpack every deps.txt wheel into OUT (no .pyc), drop trim.txt paths,
    add the stand-ins. OUT gets site.json (what was shipped/trimmed)."""
    deps = read_deps(a.deps)
    trim = read_trim(a.trim)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    shipped, trimmed, used = {}, [], set()
    for name, ver in sorted(deps.items()):
        w = find_wheel(a.cache, name, ver)
        if w is None:
            die(f"{name}=={ver}: no wheel in {a.cache} (run scripts/bundle.sh, "
                "which downloads them)")
        shipped[name] = {"version": ver, "wheel": w.name, "sha256": sha256_file(w)}
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                n = info.filename
                if n.endswith("/") or n.endswith((".pyc", ".pyo")) or \
                        "/__pycache__/" in f"/{n}":
                    continue
                if ".." in n.split("/") or n.startswith("/"):
                    die(f"{w.name}: unsafe member {n}")
                hit = next((g for g, _ in trim if fnmatch.fnmatchcase(n, g)), None)
                if hit is not None:
                    used.add(hit)
                    trimmed.append(n)
                    continue
                dest = out / "site" / n
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(n))
                if (info.external_attr >> 16) & 0o111:
                    os.chmod(dest, 0o755)
    unused = [g for g, _ in trim if g not in used]
    if unused:
        die(f"{a.trim}: rule(s) match nothing: {unused}")
    for rel, text in STAND_INS.items():
        dest = out / rel if rel.startswith("site/") else out / "vllm-bin" / rel
        if dest.exists():
            die(f"stand-in {rel} would replace a shipped file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (out / "site.json").write_text(json.dumps(
        {"shipped": shipped, "trimmed_files": len(trimmed),
         "trim_rules": dict(trim), "stand_ins": sorted(STAND_INS)}, indent=1))
    print(f"site: {len(shipped)} wheels, {len(trimmed)} trimmed file(s), "
          f"{len(STAND_INS)} stand-ins", file=sys.stderr)


# ---------------------------------------------------------------------------
# precompiled members of the vLLM wheel
# ---------------------------------------------------------------------------

# What vLLM 0.26.0's precompiled mode (setup.py,
# precompiled_wheel_utils.extract_precompiled_and_patch_package) takes from
# the wheel; scripts/build.sh builds the CPU-tier wheel the same way.
PRECOMPILED_EXACT = {
    "vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/_qutlass_C.abi3.so",
    "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_sparse_flashmla_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/cumem_allocator.abi3.so", "vllm/spinloop.abi3.so",
    "vllm/fs_io_C.abi3.so", "vllm/_rocm_C.abi3.so", "vllm/vllm-rs",
}
PRECOMPILED_REGEX = [
    re.compile(r"vllm/_rust_[^/]*\.so$"),
    re.compile(r"vllm/vllm_flash_attn/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py"),
    re.compile(r"vllm/third_party/triton_kernels/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py"),
    re.compile(r"vllm/third_party/flashmla/(?:[^/.][^/]*/)*(?!\.)[^/]*\.py"),
    re.compile(r"vllm/third_party/deep_gemm/.*"),
    re.compile(r"vllm/third_party/fmha_sm100/.*"),
    re.compile(r"vllm/third_party/tml_fa4/.*"),
]
PRECOMPILED_SKIP = {"vllm/vllm_flash_attn/__init__.py",
                    "vllm/vllm_flash_attn/flash_attn_interface.py"}


def is_precompiled(name: str) -> bool:
    if name in PRECOMPILED_EXACT:
        return True
    if name in PRECOMPILED_SKIP:
        return False
    return any(r.match(name) for r in PRECOMPILED_REGEX)


def read_member_rules(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """precompiled.txt: `exclude GLOB reason` and `prune GLOB` lines."""
    excl, prune = [], []
    for ln in config_lines(path, trailing_comments=False):
        kind, _, rest = ln.partition(" ")
        glob, _, reason = rest.strip().partition(" ")
        if kind == "exclude":
            if not reason.strip():
                die(f"{path}: exclude {glob} has no reason")
            excl.append((glob, reason.strip()))
        elif kind == "prune":
            prune.append(glob)
        else:
            die(f"{path}: unknown rule '{kind}'")
    return excl, prune


def cmd_precompiled(a: argparse.Namespace) -> None:
    excl, prune = read_member_rules(a.rules)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    taken, dropped = [], []
    used = set()
    prune_tool = HERE / "fatbin_prune.py"
    with zipfile.ZipFile(a.wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/") or not is_precompiled(name):
                continue
            hit = next((g for g, _ in excl if fnmatch.fnmatchcase(name, g)), None)
            if hit is not None:
                used.add(hit)
                dropped.append(name)
                continue
            dest = out / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = z.read(name)
            if any(fnmatch.fnmatchcase(name, g) for g in prune):
                with tempfile.NamedTemporaryFile(suffix=".so") as tmp:
                    tmp.write(data)
                    tmp.flush()
                    res = subprocess.run(
                        [sys.executable, str(prune_tool), "prune", tmp.name,
                         str(dest), "--keep-arch", a.keep_arch],
                        capture_output=True, text=True)
                    if res.returncode != 0:
                        die(f"fatbin_prune failed on {name}: {res.stderr}")
                    print(f"pruned {name}: {res.stdout.strip().splitlines()[-1]}",
                          file=sys.stderr)
            else:
                dest.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, 0o755 if mode & 0o111 else 0o644)
            taken.append(name)
    unused = [g for g, _ in excl if g not in used]
    if unused:
        die(f"{a.rules}: exclude rule(s) match nothing in the wheel: {unused}")
    (out / "precompiled.json").write_text(json.dumps(
        {"taken": sorted(taken), "excluded": sorted(dropped)}, indent=1))
    print(f"precompiled: {len(taken)} member(s) taken, {len(dropped)} excluded",
          file=sys.stderr)


# ---------------------------------------------------------------------------
# Deterministic multi-stream .tar.xz parts
# ---------------------------------------------------------------------------
# Every unit (a file, or a directory under the split threshold) is compressed
# once, as its own xz stream of tar member records without the end-of-archive
# blocks. A part is the concatenation of some units' streams plus one stream
# of the end-of-archive blocks: xz, GNU tar and Python's lzma read
# concatenated streams as one, so each part is a standalone .tar.xz.

def _junk(rel: str) -> bool:
    return rel.endswith((".pyc", ".pyo")) or "__pycache__" in rel.split("/")


def _members(root: Path, rel: str) -> list[str]:
    p = root / rel
    if p.is_file():
        return [] if _junk(rel) else [rel]
    out = []
    for d, dirs, files in os.walk(p):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith((".pyc", ".pyo")):
                continue
            out.append(os.path.relpath(os.path.join(d, f), root))
    return out


def _units(root: Path, rel: str, split: int) -> list[str]:
    p = root / rel
    if p.is_file() or p.is_symlink():
        return [] if _junk(rel) else [rel]
    size = sum((root / m).stat().st_size for m in _members(root, rel))
    if size <= split:
        return [rel] if _members(root, rel) else []
    out = []
    for child in sorted(os.listdir(p)):
        if child == "__pycache__":
            continue
        out += _units(root, os.path.join(rel, child) if rel != "." else child, split)
    return out


def _tar_records(root: Path, names: list[str]) -> bytes:
    buf = io.BytesIO()
    for rel in names:
        src = root / rel
        if src.is_symlink():
            die(f"symlink in bundle input: {src}")
        data = src.read_bytes()
        ti = tarfile.TarInfo(rel)
        ti.size = len(data)
        ti.mtime = TAR_MTIME
        ti.mode = 0o755 if os.stat(src).st_mode & 0o111 else 0o644
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        buf.write(ti.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8",
                           errors="strict"))
        buf.write(data)
        if len(data) % 512:
            buf.write(b"\0" * (512 - len(data) % 512))
    return buf.getvalue()


def _compress_unit(job: tuple[str, str, int]) -> tuple[str, bytes, int]:
    root, rel, preset = job
    names = _members(Path(root), rel)
    raw = _tar_records(Path(root), names)
    return rel, lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                              preset=preset | lzma.PRESET_EXTREME
                              if preset >= 9 else preset), len(raw)


END_OF_ARCHIVE = lzma.compress(b"\0" * 1024, format=lzma.FORMAT_XZ,
                               check=lzma.CHECK_CRC64)


def cmd_pack(a: argparse.Namespace) -> None:
    root = a.root.resolve()
    limit = int(a.part_mib * MIB)
    tops = sorted(x for x in os.listdir(root) if x != "__pycache__")
    units = []
    for t in tops:
        units += _units(root, t, int(a.split_mib * MIB))
    jobs = [(str(root), u, a.preset) for u in units]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        done = list(pool.map(_compress_unit, jobs, chunksize=1))
    budget = limit - len(END_OF_ARCHIVE)
    for rel, blob, _ in done:
        if len(blob) > budget:
            die(f"{rel} alone compresses to {len(blob) / MIB:.1f} MiB, over the "
                f"part limit of {a.part_mib} MiB")
    # first-fit decreasing; ties broken by path so the result is stable
    order = sorted(done, key=lambda d: (-len(d[1]), d[0]))
    bins: list[list] = []
    for item in order:
        for b in bins:
            if b[0] + len(item[1]) <= budget:
                b[0] += len(item[1])
                b[1].append(item)
                break
        else:
            bins.append([len(item[1]), [item]])
    a.out.mkdir(parents=True, exist_ok=True)
    parts = []
    raw_total = 0
    for i, (_, items) in enumerate(bins, 1):
        items.sort(key=lambda d: d[0])
        path = a.out / f"{a.name}-{i}.tar.xz"
        with open(path, "wb") as f:
            for _, blob, _ in items:
                f.write(blob)
            f.write(END_OF_ARCHIVE)
        raw = sum(r for _, _, r in items)
        raw_total += raw
        parts.append({"file": path.name, "bytes": path.stat().st_size,
                      "mib": round(path.stat().st_size / MIB, 2),
                      "sha256": sha256_file(path), "raw_bytes": raw,
                      "units": len(items)})
    summary = {"name": a.name, "part_mib": a.part_mib, "parts": parts,
               "raw_bytes": raw_total}
    a.json.write_text(json.dumps(summary, indent=1))
    for p in parts:
        print(f"{p['file']}: {p['mib']} MiB ({p['units']} units, "
              f"{p['raw_bytes'] / MIB:.1f} MiB unpacked)", file=sys.stderr)


# ---------------------------------------------------------------------------
# verify / env-check
# ---------------------------------------------------------------------------

def cmd_base_fingerprint(a: argparse.Namespace) -> None:
    """Hash of the code that decides the base part's bytes (so editing, say,
    env-check does not force the minutes-long base rebuild)."""
    import inspect

    mod = sys.modules[__name__]
    h = hashlib.sha256()
    for name in ("MARKER_ENV", "PIP_PLATFORM", "TAR_MTIME", "STAND_INS",
                 "PRECOMPILED_EXACT", "PRECOMPILED_SKIP"):
        h.update(repr(sorted(getattr(mod, name).items()) if isinstance(
            getattr(mod, name), dict) else sorted(map(str, getattr(mod, name)))
            if isinstance(getattr(mod, name), (set, list)) else getattr(mod, name)).encode())
    h.update(repr([r.pattern for r in PRECOMPILED_REGEX]).encode())
    for fn in (config_lines, read_reasons, read_names, read_excluded, read_deps,
               find_wheel, wheel_name_version,
               read_trim, cmd_site, is_precompiled, read_member_rules,
               cmd_precompiled, _junk, _members, _units, _tar_records,
               _compress_unit, cmd_pack):
        h.update(inspect.getsource(fn).encode())
    print(h.hexdigest()[:16])


def cmd_verify(a: argparse.Namespace) -> None:
    manifest = json.loads((a.bundle / "bundle.json").read_text())
    kinds = a.kind or ["base", "patch"]
    errors = []
    for kind in kinds:
        sec = manifest[kind]
        for p in sec["parts"]:
            path = a.bundle / p["file"]
            if not path.is_file():
                errors.append(f"{p['file']}: missing")
                continue
            if path.stat().st_size != p["bytes"]:
                errors.append(f"{p['file']}: {path.stat().st_size} bytes, "
                              f"manifest says {p['bytes']}")
            elif sha256_file(path) != p["sha256"]:
                errors.append(f"{p['file']}: sha256 differs from the manifest")
            if p["bytes"] > sec["part_mib"] * MIB:
                errors.append(f"{p['file']}: over the {sec['part_mib']} MiB limit")
    for e in errors:
        print(f"[gpu_bundle] verify: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)


def cmd_env_check(a: argparse.Namespace) -> None:
    """vLLM's requirements, and those of every shipped package, against what
    the running interpreter has: missing or outside the specifier. Excluded
    packages (excluded.txt) are counted apart: absent on purpose."""
    import importlib.metadata as md

    manifest = json.loads(Path(a.manifest).read_text())
    excluded = {cn(k) for k in manifest.get("excluded_packages", {})}
    shipped = manifest.get("base", {}).get("deps", {})
    result = {"vllm": None, "missing": [], "mismatch": [], "excluded_absent": [],
              "deps_missing": [], "deps_mismatch": []}

    def check(owner: str, lines, missing: list, mismatch: list) -> None:
        for line in lines or []:
            r = Requirement(line)
            if r.marker is not None and not r.marker.evaluate({**MARKER_ENV, "extra": ""}):
                continue
            try:
                have = md.version(r.name)
            except md.PackageNotFoundError:
                if cn(r.name) in excluded:
                    result["excluded_absent"].append(f"{owner}: {r}")
                else:
                    missing.append(f"{owner}: {r}" if owner != "vllm" else str(r))
                continue
            if not r.specifier.contains(have, prereleases=True):
                mismatch.append((f"{owner}: " if owner != "vllm" else "") + f"{r} (have {have})")

    dist = md.distribution("vllm")
    result["vllm"] = dist.version
    check("vllm", dist.requires, result["missing"], result["mismatch"])
    for name in sorted(shipped):
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            result["deps_missing"].append(f"{name} (shipped, but not importable)")
            continue
        check(name, d.requires, result["deps_missing"], result["deps_mismatch"])
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))
    print(f"vllm {result['vllm']}; missing {result['missing'] or 'none'}; "
          f"version mismatch {result['mismatch'] or 'none'}; shipped packages' "
          f"requirements missing {result['deps_missing'] or 'none'}, mismatched "
          f"{result['deps_mismatch'] or 'none'}; "
          f"{len(result['excluded_absent'])} excluded requirement(s) absent as intended")


# ---------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    p = scriptlib.doc_parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = dict(image=CONF / "image-packages.txt",
                  excluded=CONF / "excluded.txt", deps=CONF / "deps.txt")

    def add_conf(sp):
        sp.add_argument("--wheel", type=Path, required=True)
        sp.add_argument("--cache", type=Path, required=True,
                        help="folder of the downloaded dependency wheels")
        sp.add_argument("--image", type=Path, default=common["image"])
        sp.add_argument("--excluded", type=Path, default=common["excluded"])

    sp = sub.add_parser("deps-resolve")
    add_conf(sp)
    sp.add_argument("--lock", type=Path, required=True)
    sp.add_argument("--out", type=Path, default=common["deps"])
    sp.set_defaults(fn=cmd_deps_resolve)

    sp = sub.add_parser("deps-fetch")
    sp.add_argument("--cache", type=Path, required=True)
    sp.add_argument("--deps", type=Path, default=common["deps"])
    sp.set_defaults(fn=cmd_deps_fetch)

    sp = sub.add_parser("deps-check")
    add_conf(sp)
    sp.add_argument("--deps", type=Path, default=common["deps"])
    sp.set_defaults(fn=cmd_deps_check)

    sp = sub.add_parser("site")
    sp.add_argument("--cache", type=Path, required=True)
    sp.add_argument("--deps", type=Path, default=common["deps"])
    sp.add_argument("--trim", type=Path, default=CONF / "trim.txt")
    sp.add_argument("--out", type=Path, required=True)
    sp.set_defaults(fn=cmd_site)

    sp = sub.add_parser("precompiled")
    sp.add_argument("--wheel", type=Path, required=True)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--rules", type=Path, default=CONF / "precompiled.txt")
    sp.add_argument("--keep-arch", default="90")
    sp.set_defaults(fn=cmd_precompiled)

    sp = sub.add_parser("pack")
    sp.add_argument("--root", type=Path, required=True)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--name", required=True)
    sp.add_argument("--json", type=Path, required=True)
    sp.add_argument("--part-mib", type=float, required=True)
    sp.add_argument("--split-mib", type=float, default=4.0,
                    help="directories larger than this become several units")
    sp.add_argument("--preset", type=int, default=9)
    sp.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    sp.set_defaults(fn=cmd_pack)

    sp = sub.add_parser("base-fingerprint")
    sp.set_defaults(fn=cmd_base_fingerprint)

    sp = sub.add_parser("verify")
    sp.add_argument("bundle", type=Path)
    sp.add_argument("--kind", action="append", choices=["base", "patch"])
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("env-check")
    sp.add_argument("--manifest", required=True)
    sp.add_argument("--json-out", default=None)
    sp.set_defaults(fn=cmd_env_check)

    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main(sys.argv[1:])
