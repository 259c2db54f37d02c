#!/usr/bin/env python3
"""The GPU wheel's kernel build, assembly and checks (scripts/build-wheel.sh).

  wheeltool.py kernels --tree TREE --out SO [--gencode G]... [--jobs N]
      compile csrc/hisparse of the generated tree with the flags of its own
      csrc/hisparse/build.py (run by the build venv's python, whose torch is
      the CUDA build the wheel pins) and link SO like vLLM links its own
      extensions: libtorch* as NEEDED, no RPATH/RUNPATH (torch is loaded
      before any extension), so no build path leaks into the wheel.
  wheeltool.py assemble --wheel W --add ARCNAME=PATH... --out-dir D --plat P
      W plus the added members, RECORD regenerated, tagged cp38-abi3-P
      (scripts/lib.sh HS_GPU_WHEEL_PLAT); a manylinux_2_28 P is refused
      unless every added ELF stays within that policy.
  wheeltool.py check --wheel W --pinned P --version V --overlay DIR
                     [--cuobjdump X] [--json OUT]
      what CI checks on CPU (see check()).
  wheeltool.py slim --wheel W --pinned P --out-dir D
      the wheel minus the compiled members it shares byte for byte with the
      pinned upstream wheel, plus carry.json (the full wheel's RECORD): what
      scripts/check-gpu-wheel.sh takes to a GPU host that cannot hold 300 MB.
  wheeltool.py verify-slim --dir D
      every member of the slim wheel equals the full wheel's RECORD entry.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import scriptlib  # scripts/: one-line usage errors

HISPARSE_SO = "vllm/_hisparse_C.abi3.so"
ABI_TAG = "cp38-abi3"
# manylinux_2_28 (PEP 600 / auditwheel policy): highest symbol versions.
MANYLINUX_2_28 = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 25), "CXXABI": (1, 3, 11)}
FIXED_ZIP_TIME = (2026, 7, 25, 0, 0, 0)  # scripts/lib.sh HS_FIXED_DATE
WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def log(msg: str) -> None:
    print(f"[wheeltool] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    print(f"[wheeltool] error: {msg}", file=sys.stderr)
    sys.exit(1)


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def dist_info(names: list[str]) -> str:
    found = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
    if len(found) != 1:
        die(f"expected one .dist-info folder, found {found}")
    return found[0]


def read_record(zf: zipfile.ZipFile) -> dict[str, tuple[str, int]]:
    di = dist_info(zf.namelist())
    out = {}
    for row in csv.reader(io.TextIOWrapper(zf.open(f"{di}/RECORD"), encoding="utf-8")):
        if not row:
            continue
        path, h, size = row[0], row[1], row[2]
        out[path] = (h, int(size) if size else -1)
    return out


def write_wheel(out: Path, members: list[tuple[zipfile.ZipInfo, bytes]]) -> None:
    """Write a wheel whose RECORD lists every member (RECORD itself last)."""
    di = dist_info([zi.filename for zi, _ in members])
    members = [(zi, d) for zi, d in members if zi.filename != f"{di}/RECORD"]
    rows = io.StringIO()
    w = csv.writer(rows, lineterminator="\n")
    for zi, data in members:
        w.writerow([zi.filename, record_hash(data), len(data)])
    w.writerow([f"{di}/RECORD", "", ""])
    rec = zipfile.ZipInfo(f"{di}/RECORD", date_time=FIXED_ZIP_TIME)
    rec.external_attr = 0o644 << 16
    members.append((rec, rows.getvalue().encode()))
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for zi, data in members:
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    tmp.replace(out)


def elf_symbol_versions(path: Path) -> dict[str, tuple[int, ...]]:
    """Highest GLIBC/GLIBCXX/CXXABI version an ELF file needs (objdump -T)."""
    res = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        die(f"objdump -T {path} failed: {res.stderr.strip()}")
    top: dict[str, tuple[int, ...]] = {}
    for fam, ver in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_([0-9.]+)\b", res.stdout):
        v = tuple(int(x) for x in ver.split("."))
        if v > top.get(fam, ()):
            top[fam] = v
    return top


def elf_dynamic(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED entries, RPATH/RUNPATH entries) from readelf -d."""
    res = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        die(f"readelf -d {path} failed: {res.stderr.strip()}")
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", res.stdout)
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]+)\]", res.stdout)
    return needed, paths


def within_manylinux_2_28(path: Path) -> tuple[bool, str]:
    top = elf_symbol_versions(path)
    over = [f"{fam}_{'.'.join(map(str, v))} > {'.'.join(map(str, MANYLINUX_2_28[fam]))}"
            for fam, v in top.items() if v > MANYLINUX_2_28[fam]]
    need = ", ".join(f"{f}_{'.'.join(map(str, v))}" for f, v in sorted(top.items()))
    return (not over), (("; ".join(over)) if over else need)


# --- kernels ---------------------------------------------------------------

def cmd_kernels(args: argparse.Namespace) -> None:
    build_py = args.tree / "csrc/hisparse/build.py"
    spec = importlib.util.spec_from_file_location("hisparse_build", build_py)
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    gencode = args.gencode or list(b.DEFAULT_GENCODE)
    nvcc = b.find_nvcc()
    includes, lib_dirs, abi, torch_version = b.torch_paths()
    import torch
    if not torch.version.cuda:
        die(f"torch {torch_version} is not a CUDA build: the kernels must be built against the CUDA torch the wheel pins")
    flags = b.compile_flags(includes, abi, gencode, False, [])
    obj_dir = args.out.parent / "obj"
    objs = b.compile_all(nvcc, flags, b.sources(), obj_dir, args.jobs)
    b.link(nvcc, objs, lib_dirs, gencode, args.out, rpath=False)
    info = {"torch": torch_version, "torch_cuda": torch.version.cuda,
            "nvcc": b.nvcc_version(nvcc), "gencode": gencode,
            "torch_target_version": b.TORCH_TARGET_VERSION,
            "sources": [s.name for s in b.sources()],
            "sha256": hashlib.sha256(args.out.read_bytes()).hexdigest()}
    args.out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"built {args.out} ({args.out.stat().st_size} bytes; torch {torch_version}, {info['nvcc']})")


# --- assemble --------------------------------------------------------------

def cmd_assemble(args: argparse.Namespace) -> None:
    m = WHEEL_RE.match(args.wheel.name)
    if not m:
        die(f"not a wheel file name: {args.wheel.name}")
    adds = []
    for spec in args.add:
        arc, _, src = spec.partition("=")
        adds.append((arc, Path(src)))
    plat = args.plat
    for arc, src in adds:
        ok, why = within_manylinux_2_28(src)
        if not ok and plat.startswith("manylinux_2_28"):
            die(f"{arc} needs {why}: it cannot be tagged {plat}")
        log(f"{arc}: {'within' if ok else 'beyond'} manylinux_2_28 ({why}); tagging {plat}")
    tag = f"{ABI_TAG}-{plat}"
    members: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(args.wheel) as zf:
        names = zf.namelist()
        di = dist_info(names)
        taken = {arc for arc, _ in adds}
        for zi in zf.infolist():
            if zi.filename in taken:
                die(f"{zi.filename} is already in {args.wheel.name}")
            data = zf.read(zi)
            if zi.filename == f"{di}/WHEEL":
                lines = [ln for ln in data.decode().splitlines() if not ln.startswith("Tag: ")]
                lines.append(f"Tag: {tag}")
                data = ("\n".join(lines) + "\n").encode()
            members.append((zi, data))
    first_di = next(i for i, (zi, _) in enumerate(members) if zi.filename.startswith(di + "/"))
    for arc, src in adds:
        zi = zipfile.ZipInfo(arc, date_time=FIXED_ZIP_TIME)
        zi.external_attr = 0o755 << 16
        members.insert(first_di, (zi, src.read_bytes()))
        first_di += 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{m['name']}-{m['version']}-{tag}.whl"
    write_wheel(out, members)
    print(out)


# --- check -----------------------------------------------------------------

def cuobjdump_archs(cuobjdump: str, so: Path) -> tuple[list[str], list[str]]:
    def listing(flag: str) -> list[str]:
        res = subprocess.run([cuobjdump, flag, str(so)], capture_output=True, text=True)
        if res.returncode != 0:
            die(f"{cuobjdump} {flag} failed: {res.stderr.strip()}")
        return res.stdout.splitlines()
    elf = sorted({m for ln in listing("--list-elf") for m in re.findall(r"\bsm_\d+[af]?\b", ln)})
    ptx = sorted({m for ln in listing("--list-ptx") for m in re.findall(r"\b(?:sm|compute)_\d+[af]?\b", ln)})
    return elf, ptx


def check(wheel: Path, pinned: Path, version: str, overlay: Path,
          cuobjdump: str | None) -> dict:
    """Fails (exit 1) with every problem found; returns the facts checked."""
    problems: list[str] = []
    facts: dict = {"wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                   "size": wheel.stat().st_size}
    m = WHEEL_RE.match(wheel.name)
    if not m:
        die(f"not a wheel file name: {wheel.name}")
    if m["name"] != "vllm" or m["version"] != version:
        problems.append(f"file name says {m['name']} {m['version']}, expected vllm {version}")
    if f"{m['py']}-{m['abi']}" != ABI_TAG:
        problems.append(f"tag {m['py']}-{m['abi']} is not {ABI_TAG} (the pinned wheel's)")
    facts["tag"] = f"{m['py']}-{m['abi']}-{m['plat']}"
    with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(pinned) as pz:
        names = set(zf.namelist())
        di = dist_info(list(names))
        meta = zf.read(f"{di}/METADATA").decode()
        wheel_meta = zf.read(f"{di}/WHEEL").decode()
        if f"Version: {version}\n" not in meta:
            problems.append(f"METADATA Version is not {version}")
        if f"Tag: {facts['tag']}" not in wheel_meta.splitlines():
            problems.append(f"WHEEL Tag does not match the file name ({facts['tag']})")
        if "Root-Is-Purelib: false" not in wheel_meta:
            problems.append("WHEEL: Root-Is-Purelib must be false (compiled members)")
        torch_reqs = re.findall(r"^Requires-Dist: (torch\b[^;\n]*)", meta, re.M)
        facts["torch_requirement"] = torch_reqs
        if "torch==2.11.0" not in [r.replace(" ", "") for r in torch_reqs]:
            problems.append(f"Requires-Dist of torch is {torch_reqs}, expected torch==2.11.0 (the CUDA build vLLM 0.26.0 pins)")
        # RECORD covers every member, hashes and sizes right.
        record = read_record(zf)
        for name in sorted(names):
            if name.endswith("/") or name == f"{di}/RECORD":
                continue
            data = zf.read(name)
            if name not in record:
                problems.append(f"{name} is not in RECORD")
            elif record[name] != (record_hash(data), len(data)):
                problems.append(f"RECORD entry of {name} does not match its content")
        for name in record:
            if name not in names:
                problems.append(f"RECORD lists {name}, which is not in the wheel")
        # The pinned wheel's compiled members, byte for byte.
        prec = read_record(pz)
        binaries = [n for n in pz.namelist() if n.endswith(".so") or n == "vllm/vllm-rs"]
        for n in binaries:
            if n not in names:
                problems.append(f"precompiled {n} of the pinned wheel is missing")
            elif record_hash(zf.read(n)) != prec[n][0]:
                problems.append(f"precompiled {n} differs from the pinned wheel's")
        facts["precompiled_members"] = len(binaries)
        # Our Python: every overlay file under vllm/ is shipped unchanged.
        shipped = 0
        for f in sorted(overlay.rglob("*")):
            rel = f.relative_to(overlay).as_posix()
            if not f.is_file() or not rel.startswith("vllm/") or "__pycache__" in rel:
                continue
            shipped += 1
            if rel not in record:
                problems.append(f"overlay file {rel} is not in the wheel")
            elif rel not in names or zf.read(rel) != f.read_bytes():
                problems.append(f"overlay file {rel} differs in the wheel")
        facts["overlay_files"] = shipped
        # The kernel extension.
        if HISPARSE_SO not in names:
            problems.append(f"{HISPARSE_SO} is missing")
        else:
            tmp = wheel.parent / ".check-hisparse_C.so"
            tmp.write_bytes(zf.read(HISPARSE_SO))
            try:
                head = tmp.read_bytes()[:20]
                if head[:4] != b"\x7fELF" or head[4] != 2 or head[16] != 3:
                    problems.append(f"{HISPARSE_SO} is not a 64-bit ELF shared object")
                needed, rpaths = elf_dynamic(tmp)
                facts["needed"] = needed
                if rpaths:
                    problems.append(f"{HISPARSE_SO} has RPATH/RUNPATH {rpaths} (a build path would leak)")
                for lib in ("libtorch_cpu.so", "libtorch_cuda.so", "libc10.so"):
                    if lib not in needed:
                        problems.append(f"{HISPARSE_SO} does not link {lib}")
                ok, why = within_manylinux_2_28(tmp)
                facts["symbol_versions"] = why
                if m["plat"].startswith("manylinux_2_28") and not ok:
                    problems.append(f"tagged manylinux_2_28 but {HISPARSE_SO} needs {why}")
                if cuobjdump:
                    elf, ptx = cuobjdump_archs(cuobjdump, tmp)
                    facts["cubin"], facts["ptx"] = elf, ptx
                    if "sm_90a" not in elf:
                        problems.append(f"{HISPARSE_SO} has no sm_90a machine code (cubins: {elf})")
                    if not ptx:
                        problems.append(f"{HISPARSE_SO} carries no PTX (JIT fallback)")
                else:
                    facts["cubin"] = facts["ptx"] = "not checked (no cuobjdump)"
            finally:
                tmp.unlink()
    if problems:
        for p in problems:
            print(f"[wheeltool] check: {p}", file=sys.stderr)
        die(f"{wheel.name}: {len(problems)} problem(s)")
    return facts


def cmd_check(args: argparse.Namespace) -> None:
    facts = check(args.wheel, args.pinned, args.version, args.overlay, args.cuobjdump)
    for k, v in facts.items():
        log(f"check {k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(facts, indent=1) + "\n")
    log(f"check passed: {args.wheel.name}")


# --- slim / verify-slim ----------------------------------------------------

def cmd_slim(args: argparse.Namespace) -> None:
    with zipfile.ZipFile(args.wheel) as zf, zipfile.ZipFile(args.pinned) as pz:
        record = read_record(zf)
        prec = read_record(pz)
        dropped, kept = [], []
        for zi in zf.infolist():
            n = zi.filename
            shared = (n.endswith(".so") or n == "vllm/vllm-rs") and n in prec and prec[n][0] == record.get(n, ("",))[0]
            if shared and n != HISPARSE_SO:
                dropped.append(n)
            else:
                kept.append((zi, zf.read(zi)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / args.wheel.name
    write_wheel(out, kept)
    carry = {"full_wheel": args.wheel.name,
             "full_sha256": hashlib.sha256(args.wheel.read_bytes()).hexdigest(),
             "pinned_wheel": args.pinned.name,
             "dropped_as_in_pinned_wheel": sorted(dropped),
             "full_record": {k: list(v) for k, v in record.items()}}
    (args.out_dir / "carry.json").write_text(json.dumps(carry, indent=1) + "\n")
    log(f"slim wheel {out} ({out.stat().st_size} bytes; {len(dropped)} compiled upstream members left out, "
        f"{sum(record[d][1] for d in dropped)} bytes)")
    print(out)


def cmd_verify_slim(args: argparse.Namespace) -> None:
    carry = json.loads((args.dir / "carry.json").read_text())
    full = {k: tuple(v) for k, v in carry["full_record"].items()}
    wheel = args.dir / carry["full_wheel"]
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        di = dist_info(zf.namelist())
        names = set(zf.namelist()) - {f"{di}/RECORD"}
        for n in sorted(names):
            data = zf.read(n)
            if full.get(n) != (record_hash(data), len(data)):
                problems.append(f"{n} differs from the full wheel's RECORD")
        want = set(full) - set(carry["dropped_as_in_pinned_wheel"]) - {f"{di}/RECORD"}
        for n in sorted(want - names):
            problems.append(f"{n} of the full wheel is missing")
    if problems:
        for p in problems:
            print(f"[wheeltool] verify-slim: {p}", file=sys.stderr)
        die(f"{wheel.name} is not the full wheel {carry['full_sha256'][:16]} minus the pinned wheel's binaries")
    log(f"verify-slim: {len(names)} members equal full wheel {carry['full_wheel']} "
        f"(sha256 {carry['full_sha256'][:16]}); {len(carry['dropped_as_in_pinned_wheel'])} upstream binaries left out")


def main() -> None:
    ap = scriptlib.doc_parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--tree", type=Path, required=True)
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("--gencode", action="append")
    k.add_argument("--jobs", type=int, default=2)
    a = sub.add_parser("assemble")
    a.add_argument("--wheel", type=Path, required=True)
    a.add_argument("--add", action="append", default=[], required=True)
    a.add_argument("--out-dir", type=Path, required=True)
    a.add_argument("--plat", required=True, choices=["linux_x86_64", "manylinux_2_28_x86_64"])
    c = sub.add_parser("check")
    c.add_argument("--wheel", type=Path, required=True)
    c.add_argument("--pinned", type=Path, required=True)
    c.add_argument("--version", required=True)
    c.add_argument("--overlay", type=Path, required=True)
    c.add_argument("--cuobjdump")
    c.add_argument("--json", type=Path)
    s = sub.add_parser("slim")
    s.add_argument("--wheel", type=Path, required=True)
    s.add_argument("--pinned", type=Path, required=True)
    s.add_argument("--out-dir", type=Path, required=True)
    v = sub.add_parser("verify-slim")
    v.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    {"kernels": cmd_kernels, "assemble": cmd_assemble, "check": cmd_check,
     "slim": cmd_slim, "verify-slim": cmd_verify_slim}[args.cmd](args)


if __name__ == "__main__":
    main()
