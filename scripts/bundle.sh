#!/usr/bin/env bash
# Pack the patched vLLM for the air-gapped GPU machine (docs/workflow.md
# "GPU bundle"): python 3.12, torch 2.11.0+cu130, nvcc 13, no network.
#
# usage: scripts/bundle.sh [--out DIR] [--part-mib N] [--prebuild-kernels]
#                          [--prebuild-python PY] [--xz-preset N] [--jobs N]
#   --out DIR            where the parts and bundle.json go (default .gpu/bundle)
#   --part-mib N         no part larger than N MiB (default 56: the base part,
#                        the patch part and the working tree fit one device
#                        call's 64 MiB)
#   --prebuild-kernels   also build the hisparse_ops extension here (nvcc +
#                        a torch >= 2.11 of any build: stable ABI) into the
#                        patch part; scripts/test-gpu.sh tries it first
#   --prebuild-python PY the interpreter whose torch headers it compiles
#                        against (default .venv/bin/python)
#   --xz-preset N        xz level of the base part (default 9, extreme);
#                        the patch part uses min(N, 6)
# Parts:
#   base-K.tar.xz   stable across commits, unpacked once per GPU machine: the
#                   vLLM wheel's precompiled members less scripts/gpu-bundle/
#                   precompiled.txt's exclusions (fat binaries pruned to
#                   sm_90), the dependencies of scripts/gpu-bundle/deps.txt
#                   and the test-bundle stand-ins. Cached under .cache/gpu-bundle.
#   patch-K.tar.xz  rebuilt every time: the patched tree's vllm/ package
#                   (scripts/apply.sh: whatever overlay/ and patches/ hold now,
#                   .py files and package data, no .so), its dist-info, the
#                   kernel sources with scripts/build-kernels.sh, vLLM's
#                   benchmarks/multi_turn (scripts/bench-agentic's load), and
#                   the prebuilt kernels when asked.
#   bundle.json     sizes and sha256 of every part, the pin, the series and
#                   overlay sha, the git commit.
source "$(dirname "$0")/lib.sh"

out=$HS_ROOT/.gpu/bundle part_mib=56 prebuild=0 prebuild_py=$HS_ROOT/.venv/bin/python
preset=9 jobs=$(nproc 2>/dev/null || echo 2)
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) hs_need 'a directory' "$@"; out=$2; shift ;;
    --part-mib) hs_need 'a number' "$@"; part_mib=$2; shift ;;
    --prebuild-kernels) prebuild=1 ;;
    --prebuild-python) hs_need 'a path' "$@"; prebuild_py=$2; shift ;;
    --xz-preset) hs_need '0-9' "$@"; preset=$2; shift ;;
    --jobs) hs_need 'a number' "$@"; jobs=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
[[ $part_mib =~ ^[0-9]+([.][0-9]+)?$ ]] || hs_die "--part-mib must be a number, got '$part_mib'"
[[ $preset =~ ^[0-9]$ ]] || hs_die "--xz-preset must be 0-9, got '$preset'"
hs_positive_int --jobs "$jobs"
out=$(realpath -m "$out")
conf=$HS_ROOT/scripts/gpu-bundle
tool=$HS_ROOT/scripts/gpu_bundle.py
cache=$HS_CACHE/gpu-bundle
wheels=$cache/wheels
t0=$(date +%s)
stamp() { printf '[bundle.sh +%ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" >&2; }
py() { "$HS_PY" "$tool" "$@"; }

# Bump when the layout of the base changes in a way its inputs do not show.
BASE_FORMAT=1

# 1. the pin (sdist for apply.sh, wheel for the precompiled members).
"$HS_ROOT/scripts/fetch.sh" --wheel
wheel=$HS_CACHE/pin/$VLLM_WHEEL_FILE

work=$(mktemp -d "${TMPDIR:-/tmp}/hisparse-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT

# 2. base: reused from the cache while its inputs are unchanged.
base_key=$( { echo "format $BASE_FORMAT preset $preset part_mib $part_mib"; echo "$VLLM_WHEEL_SHA256";
             py base-fingerprint; cat "$HS_ROOT/scripts/fatbin_prune.py" "$conf"/*.txt; } | sha256sum | cut -c1-20)
base_dir=$cache/base-$base_key
if [[ -f "$base_dir/base.json" ]]; then
  stamp "base: cached ($base_dir)"
else
  stamp "base: building (key $base_key)"
  # dependency wheels, downloaded once into the cache
  py deps-fetch --cache "$wheels"
  py deps-check --wheel "$wheel" --cache "$wheels"
  stage=$work/base
  py precompiled --wheel "$wheel" --out "$stage/vllm-bin"
  py site --cache "$wheels" --out "$stage"
  rm -rf "$base_dir.tmp"; mkdir -p "$base_dir.tmp"
  py pack --root "$stage" --out "$base_dir.tmp" --name base --json "$base_dir.tmp/pack.json" \
    --part-mib "$part_mib" --preset "$preset" --jobs "$jobs"
  "$HS_PY" - "$stage" "$base_dir.tmp" "$base_key" <<'EOF'
import json, sys
from pathlib import Path
stage, dest, key = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
pack = json.loads((dest / "pack.json").read_text())
pre = json.loads((stage / "vllm-bin/precompiled.json").read_text())
site = json.loads((stage / "site.json").read_text())
json.dump({"key": key, "parts": pack["parts"], "raw_bytes": pack["raw_bytes"],
           "precompiled_taken": pre["taken"], "precompiled_excluded": len(pre["excluded"]),
           "deps": {k: v["version"] for k, v in site["shipped"].items()},
           "trim_rules": site["trim_rules"], "stand_ins": site["stand_ins"]},
          open(dest / "base.json", "w"), indent=1)
EOF
  rm -rf "$base_dir"; mv "$base_dir.tmp" "$base_dir"
  rm -rf "$stage"
  # keep the cache small: only the newest base
  for old in "$cache"/base-*; do [[ "$old" == "$base_dir" ]] || rm -rf "$old"; done
fi

# 3. patch: the patched tree's vllm/ package + kernel sources (+ prebuilt).
stamp "patch: applying the series"
tree=$work/tree
"$HS_ROOT/scripts/apply.sh" --to "$tree" --force
pstage=$work/patch
mkdir -p "$pstage/site" "$pstage/kernels/scripts" "$pstage/kernels/overlay/csrc"
"$HS_PY" - "$tree" "$pstage" "$base_dir/base.json" "$wheel" "$HS_VERSION" <<'EOF'
import json, shutil, sys, zipfile
from pathlib import Path
tree, stage, base_json, wheel, version = (Path(sys.argv[1]), Path(sys.argv[2]),
                                          Path(sys.argv[3]), sys.argv[4], sys.argv[5])
shadow = set(json.loads(base_json.read_text())["precompiled_taken"])
n = skipped = 0
for src in sorted((tree / "vllm").rglob("*")):
    rel = src.relative_to(tree).as_posix()
    if src.is_dir() or "__pycache__" in src.parts or src.suffix in (".pyc", ".pyo", ".so"):
        continue
    if src.is_symlink():
        sys.exit(f"bundle.sh: symlink in the patched tree: {rel}")
    if rel in shadow:  # the wheel's precompiled copy wins, as in precompiled mode
        skipped += 1
        continue
    dest = stage / "site" / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)
    n += 1
# dist-info: the wheel's METADATA and entry points, at our version
di = stage / "site" / f"vllm-{version}.dist-info"
di.mkdir()
with zipfile.ZipFile(wheel) as z:
    name = next(x for x in z.namelist() if x.endswith(".dist-info/METADATA"))
    meta = z.read(name).decode()
    eps = z.read(name.replace("METADATA", "entry_points.txt")).decode()
lines = [f"Version: {version}" if l.startswith("Version: ") else l for l in meta.split("\n")]
(di / "METADATA").write_text("\n".join(lines))
(di / "entry_points.txt").write_text(eps)
(di / "top_level.txt").write_text("vllm\n")
(di / "INSTALLER").write_text("hisparse-gpu-bundle\n")
print(f"patch: {n} files of vllm/ ({skipped} shadowed by the base's precompiled members)",
      file=sys.stderr)
EOF
cp "$HS_ROOT/scripts/build-kernels.sh" "$pstage/kernels/scripts/"
[[ -d "$tree/csrc/hisparse" ]] || hs_die "the patched tree has no csrc/hisparse (kernel sources)"
cp -r "$tree/csrc/hisparse" "$pstage/kernels/overlay/csrc/"
# vLLM's own multi-turn serving benchmark: scripts/bench-agentic's load
# generator (STAGE/patch/benchmarks/multi_turn on the GPU host)
[[ -f "$tree/benchmarks/multi_turn/benchmark_serving_multi_turn.py" ]] \
  || hs_die "the patched tree has no benchmarks/multi_turn/benchmark_serving_multi_turn.py"
mkdir -p "$pstage/benchmarks"
cp -r "$tree/benchmarks/multi_turn" "$pstage/benchmarks/"
find "$pstage" \( -name __pycache__ -o -name '*.pyc' -o -name '*.so' -o -name '*.o' \) -prune -exec rm -rf {} +
ksha=$(cd "$pstage/kernels" && find . -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)

prebuilt_json=null
if [[ $prebuild == 1 ]]; then
  stamp "prebuilt kernels: compiling with $(command -v nvcc || echo 'no nvcc') against $prebuild_py's torch"
  [[ -x "$prebuild_py" ]] || hs_die "--prebuild-kernels: no interpreter at $prebuild_py (pass --prebuild-python)"
  command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || hs_die "--prebuild-kernels needs nvcc"
  kb=$work/kbuild
  "$pstage/kernels/scripts/build-kernels.sh" --compile-only --python "$prebuild_py" --out "$kb" >"$work/kbuild.log" 2>&1 \
    || { tail -30 "$work/kbuild.log" >&2; hs_die "prebuilt kernels: compilation failed"; }
  mkdir -p "$pstage/prebuilt"
  "$prebuild_py" "$HS_ROOT/scripts/gpu_prebuild.py" link --build "$kb" --sources "$pstage/kernels/overlay/csrc/hisparse" \
    --out "$pstage/prebuilt" --sources-sha "$ksha" || hs_die "prebuilt kernels: link or checks failed"
  prebuilt_json=$pstage/prebuilt/hisparse_ops/BUILD_INFO.json
fi

stamp "patch: packing"
rm -rf "$work/patch-parts"
py pack --root "$pstage" --out "$work/patch-parts" --name patch --json "$work/patch-parts/pack.json" \
  --part-mib "$part_mib" --preset "$(( preset < 6 ? preset : 6 ))" --split-mib 12 --jobs "$jobs"

# 4. the output folder: parts + manifest (stale parts removed).
mkdir -p "$out"
rm -f "$out"/base-*.tar.xz "$out"/patch-*.tar.xz "$out/bundle.json"
for f in "$base_dir"/base-*.tar.xz; do ln -f "$f" "$out/" 2>/dev/null || cp "$f" "$out/"; done
mv "$work/patch-parts"/patch-*.tar.xz "$out/"
series_sha=$(hs_series_sha)
overlay_sha=$(hs_overlay_sha)
commit=$(git -C "$HS_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$( [[ -n "$(git -C "$HS_ROOT" status --porcelain -- overlay patches scripts 2>/dev/null)" ]] && echo true || echo false)
"$HS_PY" - "$out" "$base_dir/base.json" "$work/patch-parts/pack.json" "$prebuilt_json" <<EOF
import json, sys
from pathlib import Path
out, base, patch, prebuilt = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), \
    json.loads(Path(sys.argv[3]).read_text()), sys.argv[4]
excluded = {}
for ln in Path("$conf/excluded.txt").read_text().splitlines():
    if ln.strip() and not ln.lstrip().startswith("#"):
        k, _, v = ln.strip().partition(" ")
        excluded[k] = v.strip()
def sha_of(parts):
    import hashlib
    return hashlib.sha256("".join(p["sha256"] for p in parts).encode()).hexdigest()
manifest = {
    "format": 1,
    "version": "$HS_VERSION",
    "pin": {"vllm_version": "$VLLM_VERSION", "sdist_sha256": "$VLLM_SDIST_SHA256",
            "wheel_sha256": "$VLLM_WHEEL_SHA256", "sdist_commit": "$VLLM_COMMIT",
            "wheel_commit": "$VLLM_WHEEL_COMMIT", "torch_gpu": "$TORCH_GPU_VERSION"},
    "series_sha": "$series_sha",
    "overlay_sha": "$overlay_sha",
    "series": [l.strip() for l in Path("$HS_PATCHES/series").read_text().splitlines()
               if l.strip() and not l.startswith("#")],
    "git_commit": "$commit",
    "git_dirty": $( [[ $dirty == true ]] && echo True || echo False ),
    "part_mib": $part_mib,
    "base": {"sha256": sha_of(base["parts"]), "key": base["key"], "part_mib": $part_mib,
             "parts": base["parts"], "raw_bytes": base["raw_bytes"],
             "precompiled_files": len(base["precompiled_taken"]),
             "compiled_extensions": [f for f in base["precompiled_taken"] if f.endswith(".so")],
             "deps": base["deps"],
             "trim_rules": base["trim_rules"], "stand_ins": base["stand_ins"]},
    "patch": {"sha256": sha_of(patch["parts"]), "part_mib": $part_mib, "parts": patch["parts"],
              "raw_bytes": patch["raw_bytes"], "kernel_sources_sha": "$ksha",
              "prebuilt_kernels": json.loads(Path(prebuilt).read_text()) if prebuilt != "null" else None},
    "excluded_packages": excluded,
}
(out / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
EOF
py verify "$out"
total=0
for f in "$out"/*.tar.xz; do total=$(( total + $(stat -c %s "$f") )); done
stamp "bundle ready in $out ($(( total / 1048576 )) MiB of parts):"
for f in "$out"/*.tar.xz; do
  stat -c '%s %n' "$f" | awk '{n=split($2,p,"/"); printf "  %-18s %6.2f MiB\n", p[n], $1/1048576}' >&2
done
echo "$out/bundle.json"
