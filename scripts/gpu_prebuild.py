#!/usr/bin/env python3
"""Prebuilt hisparse_ops for the GPU bundle, and its smoke test.

  link   (scripts/bundle.sh --prebuild-kernels, on a machine without a GPU)
         Link the objects of `scripts/build-kernels.sh --compile-only` into
         the `hisparse_ops` package the way overlay/csrc/hisparse/build.py
         would on the GPU host, against this interpreter's torch (any build,
         CPU-only included), then prove the result depends on torch only
         through the libtorch stable C shim of the TORCH_TARGET_VERSION
         (2.11) that build.py pins, so that it loads into the GPU host's torch
         2.11.0+cu130:
           - every undefined torch symbol is a C shim function
             (aoti_torch_* / torch_*), no C++ symbol of c10/at/torch;
           - NEEDED holds only torch's libraries by soname (resolved to the
             ones the importing process already loaded), CUDA 13's runtime
             and the C/C++ runtime; no RPATH/RUNPATH;
           - the library loads into this torch and registers every op.
         A CPU torch has no libtorch_cuda.so: the CUDA shim functions the
         objects call (aoti_torch_get_current_cuda_stream) are linked against
         a stub of that soname, so NEEDED matches a GPU-host build.
  smoke  (scripts/test-gpu.sh, on the GPU host) import hisparse_ops from
         PYTHONPATH, check the ops, run one tiny gather_compact on the GPU and
         compare it with the expected rows. Exit 0 only when all of that holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import scriptlib  # scripts/: one-line usage errors

REQUIRED_OPS = ("resolve_residency", "gather_compact", "gather_plan",
                "invalidate_written_slots", "copy_descriptors")
ALLOWED_NEEDED = {"libc10.so", "libtorch.so", "libtorch_cpu.so",
                  "libtorch_cuda.so", "libcudart.so.13", "libstdc++.so.6",
                  "libgcc_s.so.1", "libc.so.6", "libm.so.6",
                  "ld-linux-x86-64.so.2", "libdl.so.2", "libpthread.so.0",
                  "librt.so.1"}
SHIM = re.compile(r"^(aoti_torch_|torch_)\w+$")
# C++ entities of torch's own namespaces (functions, typeinfo, vtables)
CXX_TORCH = re.compile(r"^_Z(?:T[ISVT])?N(?:K)?(?:3c10|5torch|2at|6caffe2)")


def die(msg: str) -> None:
    print(f"[gpu_prebuild] error: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def symbols(args: list[str]) -> list[str]:
    res = run(["nm", *args])
    if res.returncode != 0:
        die(f"nm failed: {res.stderr.strip()}")
    out = []
    for ln in res.stdout.splitlines():
        parts = ln.split()
        if parts and not ln.endswith(":"):
            out.append(parts[-1])
    return out


def load_build_py(sources: Path):
    spec = importlib.util.spec_from_file_location("hisparse_build",
                                                  sources / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cudart_dir(nvcc: Path) -> Path | None:
    for d in (nvcc.parent.parent / "lib64", nvcc.parent.parent / "lib"):
        if (d / "libcudart.so.13").exists():
            return d
    return None


def cmd_link(a: argparse.Namespace) -> None:
    import torch
    from torch.utils import cpp_extension

    build = load_build_py(a.sources)
    nvcc = build.find_nvcc()
    objs = sorted((a.build / "obj").glob("*.o"))
    if not objs:
        die(f"no objects in {a.build / 'obj'} (run build-kernels.sh --compile-only)")
    lib_dirs = cpp_extension.library_paths()
    torch_lib = Path(torch.__file__).parent / "lib"

    # 1. torch symbols the objects need, and the ones this torch lacks
    undefined = set(symbols(["-u", *map(str, objs)])) - \
        set(symbols(["--defined-only", *map(str, objs)]))
    need_torch = sorted(s for s in undefined if SHIM.match(s))
    cxx = sorted(s for s in undefined if CXX_TORCH.match(s))
    if cxx:
        die(f"the objects use C++ symbols of torch (not the stable ABI): {cxx[:5]}")
    defined = set()
    for lib in ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so"):
        if (torch_lib / lib).exists():
            defined.update(symbols(["-D", "--defined-only", str(torch_lib / lib)]))
    absent = [s for s in need_torch if s not in defined]
    if any("cuda" not in s for s in absent):
        die(f"this torch ({torch.__version__}) lacks non-CUDA shim symbols "
            f"{[s for s in absent if 'cuda' not in s]}: build against torch >= 2.11")

    # 2. a stub libtorch_cuda.so when this torch has none (CPU build)
    link_dirs = list(lib_dirs)
    stub_dir = a.build / "stub"
    if not (torch_lib / "libtorch_cuda.so").exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "torch_cuda_stub.c"
        src.write_text("/* link-time stand-in for libtorch_cuda.so (never loaded) */\n"
                       + "".join(f"void {s}(void) {{}}\n" for s in absent))
        res = run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libtorch_cuda.so",
                   "-o", str(stub_dir / "libtorch_cuda.so"), str(src)])
        if res.returncode != 0:
            die(f"stub link failed: {res.stderr}")
        link_dirs.append(str(stub_dir))

    # 3. build.py's link, without the rpath to this machine's torch
    lib = a.build / build.LIBRARY_NAME
    build.link(nvcc, objs, link_dirs, list(build.DEFAULT_GENCODE), lib, rpath=False)

    # 4. what the library needs at load time
    dyn = run(["readelf", "-d", str(lib)]).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    if re.search(r"\((RPATH|RUNPATH)\)", dyn):
        die("the library has an RPATH/RUNPATH")
    odd = [n for n in needed if n not in ALLOWED_NEEDED]
    if odd:
        die(f"unexpected NEEDED entries: {odd}")
    dyn_undef = symbols(["-D", "--undefined-only", str(lib)])
    torch_syms = sorted({s.split("@")[0] for s in dyn_undef if SHIM.match(s.split("@")[0])})
    cxx = [s for s in dyn_undef if CXX_TORCH.match(s)]
    if cxx:
        die(f"the library uses C++ symbols of torch: {cxx[:5]}")
    glibc = sorted({tuple(int(x) for x in m.split("."))
                    for m in re.findall(r"@GLIBC_(\d+\.\d+(?:\.\d+)?)", " ".join(dyn_undef))})
    max_glibc = ".".join(map(str, glibc[-1])) if glibc else None

    # 5. it loads into this torch and registers every op
    env = dict(os.environ)
    extra = [str(stub_dir)] if stub_dir.exists() else []
    cd = cudart_dir(nvcc)
    if cd is not None:
        extra.append(str(cd))
    env["LD_LIBRARY_PATH"] = ":".join(extra + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    probe = ("import sys, torch\n"
             f"torch.ops.load_library({str(lib)!r})\n"
             "ops = torch.ops.hisparse_ops\n"
             f"missing = [n for n in {REQUIRED_OPS!r} if not hasattr(ops, n)]\n"
             "assert not missing, missing\n"
             "n = ops.resolver_smem_bytes(2048, 1, 2048)\n"
             "assert isinstance(n, int) and n > 0, n\n"
             "print(n)\n")
    res = subprocess.run([sys.executable, "-c", probe], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        die(f"the library does not load into torch {torch.__version__}:\n{res.stderr}")

    # 6. the package, as build.py installs it
    info = {"torch": torch.__version__, "nvcc": build.nvcc_version(nvcc),
            "gencode": list(build.DEFAULT_GENCODE),
            "torch_target_version": build.TORCH_TARGET_VERSION, "defines": [],
            "prebuilt": True, "sources_sha": a.sources_sha,
            "needed": needed, "torch_symbols": torch_syms,
            "max_glibc": max_glibc,
            "stubbed": absent if stub_dir.exists() else []}
    pkg = a.out / build.PACKAGE
    if pkg.exists():
        shutil.rmtree(pkg)
    build.install_package(pkg, lib, info)
    (pkg / "BUILD_INFO.json").write_text(json.dumps(info, indent=1))
    print(f"prebuilt: {pkg} ({(pkg / build.LIBRARY_NAME).stat().st_size} bytes; "
          f"{len(torch_syms)} shim symbols; NEEDED {', '.join(needed)}; "
          f"GLIBC <= {max_glibc})", file=sys.stderr)


def cmd_smoke(a: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        die("no CUDA device")
    import hisparse_ops  # noqa: F401  (registers torch.ops.hisparse_ops)

    ops = torch.ops.hisparse_ops
    missing = [n for n in REQUIRED_OPS if not hasattr(ops, n)]
    if missing:
        die(f"ops missing: {missing}")
    dev = "cuda"
    W = 32
    src = torch.arange(8 * W, dtype=torch.int32, device=dev).remainder(251) \
        .to(torch.uint8).reshape(8, W)
    dst = torch.zeros(2, 4, W, dtype=torch.uint8, device=dev)  # [N, B, W]
    plan_src = torch.tensor([[5, 2, 7]], dtype=torch.int32, device=dev)
    plan_dst = torch.tensor([[0, 6, 3]], dtype=torch.int32, device=dev)
    plan_count = torch.tensor([2], dtype=torch.int32, device=dev)  # third unused
    ops.gather_compact(src, dst, plan_src, plan_dst, plan_count)
    torch.cuda.synchronize()
    flat = dst.reshape(8, W).cpu()
    want = torch.zeros(8, W, dtype=torch.uint8)
    want[0] = src[5].cpu()
    want[6] = src[2].cpu()
    if not torch.equal(flat, want):
        die("gather_compact gave wrong rows")
    info = getattr(hisparse_ops, "BUILD_INFO", {})
    print(json.dumps({"ok": True, "library": str(hisparse_ops.LIBRARY),
                      "torch": torch.__version__,
                      "built_with_torch": info.get("torch"),
                      "prebuilt": bool(info.get("prebuilt"))}))


def main(argv: list[str]) -> None:
    p = scriptlib.doc_parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("link")
    sp.add_argument("--build", type=Path, required=True)
    sp.add_argument("--sources", type=Path, required=True)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--sources-sha", required=True)
    sp.set_defaults(fn=cmd_link)
    sp = sub.add_parser("smoke")
    sp.set_defaults(fn=cmd_smoke)
    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main(sys.argv[1:])
