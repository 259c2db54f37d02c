"""ci/pipeline.yml: the tiers a user runs on their own infrastructure, and
.ci/run: this repository's CI, which must need nothing a fresh machine lacks
beyond what scripts/build.sh installs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PIPE = yaml.safe_load((ROOT / "ci/pipeline.yml").read_text())
# Written by another part of the project; called as a black box.
EXTERNAL = {"scripts/test-gpu.sh"}


def runs(job: str) -> list[str]:
    return [s["run"] for s in PIPE["jobs"][job]["steps"] if "run" in s]


def test_tiers_and_their_order():
    jobs = PIPE["jobs"]
    assert set(jobs) == {"lint", "cpu", "wheel", "image", "gpu"}
    assert jobs["cpu"]["needs"] == "lint" and jobs["wheel"]["needs"] == "lint"
    assert jobs["image"]["needs"] == "wheel" and set(jobs["gpu"]["needs"]) == {"cpu", "wheel"}
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "h200"]
    assert "nvidia/cuda:13.0" in jobs["wheel"]["container"]


def test_cpu_tier_runs_the_readme_commands():
    steps = runs("cpu")
    for cmd in ("scripts/build.sh", "scripts/validate.sh", "scripts/test.sh"):
        assert cmd in steps
    assert steps.index("scripts/build.sh") < steps.index("scripts/test.sh")


def test_gpu_tier_checks_the_wheel_builds_the_kernels_and_runs_test_gpu():
    steps = " ; ".join(runs("gpu"))
    order = ["scripts/check-gpu-wheel.sh dist/gpu/", "scripts/build.sh --tier gpu",
             "scripts/build-kernels.sh", "scripts/test-gpu.sh"]
    assert [steps.index(s) for s in order] == sorted(steps.index(s) for s in order)


def test_every_script_the_pipeline_names_exists():
    named = set()
    for job in PIPE["jobs"]:
        for r in runs(job):
            named.update(re.findall(r"scripts/[\w.-]+", r))
    assert named >= {"scripts/build-wheel.sh", "scripts/check-gpu-wheel.sh", "scripts/build-image.sh"}
    for s in named - EXTERNAL:
        assert (ROOT / s).is_file(), s


def test_ci_run_leaves_set_up_to_the_readme_commands():
    text = (ROOT / ".ci/run").read_text()
    assert "apt-get" not in text and "stgit" not in text.replace("stgit through apt", "")
    cmds = [ln.strip() for ln in text.splitlines() if ln.startswith("scripts/")]
    assert cmds == ["scripts/validate.sh --lint-only", "scripts/build.sh", "scripts/validate.sh", "scripts/test.sh"]
    readme = (ROOT / "README.md").read_text()
    assert "scripts/build.sh" in readme and "scripts/test.sh" in readme
