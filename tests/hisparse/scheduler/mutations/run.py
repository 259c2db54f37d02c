# SPDX-License-Identifier: Apache-2.0
"""Mutation testing of the HiSparse scheduler side against
tests/hisparse/scheduler (run from the repository root, after
scripts/build.sh):

    .venv/bin/python tests/hisparse/scheduler/mutations/run.py [ID ...]
        [--steps N] [--timeout S] [--out PATH] [--tests PATH]

Each mutation of mutations.json is applied alone to the *installed* copy of
its file (.venv/.../vllm/v1/hisparse/<file>), the scheduler tests run with
``-x`` (first failure kills the mutation), and the file is restored from
the overlay (it must equal the overlay before the run starts). The property
test runs HISPARSE_PROPERTY_STEPS=N steps per seed (default 2000: a kill by
the 10,000-step run is not recorded; a survivor is then rerun with the full
count when --confirm is given). Results go to results.json next to this file
(or --out): per mutation killed / survived / timeout, the first failing test
and the reported error line, plus the command, the overlay sha256s and the
wall time. A mutation whose ``find`` text does not occur exactly once is
reported as ``stale`` and not run (the code it targets changed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
OVERLAY = ROOT / "overlay" / "vllm" / "v1" / "hisparse"


def installed_dir(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import vllm.v1.hisparse as m, os; print(os.path.dirname(m.__file__))"],
        check=True, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "ci" / "cpu_test_harness")},
    )
    return Path(out.stdout.strip().splitlines()[-1])


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def first_failure(output: str) -> tuple[str | None, str | None]:
    test = None
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if m:
        test = m.group(1)
    err = None
    for line in output.splitlines():
        if line.startswith("E   "):
            err = line[1:].strip()[:300]
            break
    return test, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="*", help="mutation ids (default: all)")
    ap.add_argument("--steps", type=int, default=2000,
                    help="HISPARSE_PROPERTY_STEPS for the runs (default 2000)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--tests", default="tests/hisparse/scheduler")
    ap.add_argument("--confirm", action="store_true",
                    help="rerun survivors with the full 10,000-step property test")
    ap.add_argument("--python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    args = ap.parse_args()

    spec = json.loads((HERE / "mutations.json").read_text())
    mutations = spec["mutations"]
    if args.ids:
        wanted = set(args.ids)
        mutations = [m for m in mutations if m["id"] in wanted]
        missing = wanted - {m["id"] for m in mutations}
        if missing:
            sys.exit(f"unknown mutation ids: {sorted(missing)}")
    target = installed_dir(args.python)
    files = sorted({m["file"] for m in spec["mutations"]})
    for f in files:
        if sha(target / f) != sha(OVERLAY / f):
            sys.exit(f"{target / f} differs from {OVERLAY / f}: run scripts/build.sh first")
    cache = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
    env = {
        **os.environ,
        "HF_HOME": os.environ.get("HF_HOME", str(cache / "hf")),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "ci" / "cpu_test_harness"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    base_cmd = [str(args.python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                "-p", "cpu_noclean", "-p", "no:warnings", args.tests]

    def run_tests(steps: int) -> tuple[str, str]:
        try:
            proc = subprocess.run(
                base_cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                env={**env, "HISPARSE_PROPERTY_STEPS": str(steps)})
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return "timeout", out
        return ("survived" if proc.returncode == 0 else "killed"), proc.stdout + proc.stderr

    results = []
    t_all = time.monotonic()
    for m in mutations:
        path = target / m["file"]
        original = (OVERLAY / m["file"]).read_text()
        count = original.count(m["find"])
        row = {"id": m["id"], "file": m["file"], "what": m["what"]}
        if "equivalent" in m:
            row["equivalent"] = m["equivalent"]
        if count != 1:
            row.update(status="stale", detail=f"'find' occurs {count} times")
            results.append(row)
            print(f"{m['id']:36s} stale ({count} matches)", flush=True)
            continue
        t0 = time.monotonic()
        try:
            path.write_text(original.replace(m["find"], m["replace"]))
            for pyc in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
                pyc.unlink()
            status, out = run_tests(args.steps)
            if status == "survived" and args.confirm:
                status, out = run_tests(10_000)
                row["confirmed_with_steps"] = 10_000
        finally:
            shutil.copyfile(OVERLAY / m["file"], path)
            for pyc in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
                pyc.unlink()
        test, err = first_failure(out) if status != "survived" else (None, None)
        row.update(status=status, killed_by=test, error=err,
                   seconds=round(time.monotonic() - t0, 1))
        if status != "survived" and test is None:
            row["tail"] = out[-1500:]
        results.append(row)
        print(f"{m['id']:36s} {status:8s} {test or ''}", flush=True)
    for f in files:
        assert sha(target / f) == sha(OVERLAY / f), f"{f} not restored"
    summary = {s: sum(r["status"] == s for r in results)
               for s in ("killed", "survived", "timeout", "stale")}
    report = {
        "command": " ".join(["tests/hisparse/scheduler/mutations/run.py", *sys.argv[1:]]),
        "pytest": " ".join(base_cmd[1:]),
        "property_steps": args.steps,
        "overlay_sha256": {f: sha(OVERLAY / f) for f in files},
        "summary": summary,
        "survivors": [r["id"] for r in results if r["status"] == "survived"],
        "survivors_not_marked_equivalent": [
            r["id"] for r in results if r["status"] == "survived" and "equivalent" not in r],
        "seconds": round(time.monotonic() - t_all, 1),
        "results": results,
    }
    if args.ids and args.out.exists():  # a partial run updates the full report
        old = json.loads(args.out.read_text())
        by_id = {r["id"]: r for r in old.get("results", [])}
        by_id.update({r["id"]: r for r in results})
        order = [m["id"] for m in spec["mutations"]]
        merged = [by_id[i] for i in order if i in by_id]
        report["results"] = merged
        report["summary"] = {s: sum(r["status"] == s for r in merged)
                             for s in ("killed", "survived", "timeout", "stale")}
        report["survivors"] = [r["id"] for r in merged if r["status"] == "survived"]
        report["survivors_not_marked_equivalent"] = [
            r["id"] for r in merged if r["status"] == "survived" and "equivalent" not in r]
        report["command"] = (
            old.get("command", report["command"]) + " (+ " + " ".join(args.ids) + ")")
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary), f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
