"""scripts/bench-scheduler's prefix-hit admission pass (P2 diagnosis,
session 13): what it times must be a prefix hit in both arms, the same
prompts, served from the cache; on the HiSparse arm, through the
host-prefix commit and the adoption of the cached GPU pages; and since
R33 (issue 16: staging spread bench-tax's prefix hits over several steps)
in as many steps as HiSparse off. The times themselves are a benchmark's,
not asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_admission_times_full_prefix_hits_in_both_arms(tmp_path):
    out = tmp_path / "sched.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench-scheduler"), "--requests", "2",
         "--steps", "2", "--prompt", "128", "--admit", "4", "--rounds", "2",
         "--admit-prompt", "4096", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adm = json.loads(out.read_text())["admission"]
    assert adm["requests"] == 4 and adm["prompt"] == 4096 and adm["rounds"] == 2
    # every prompt hits whole but its last block, which the pin recomputes
    full = 4 * (4096 - 64)
    for arm in ("off", "on"):
        assert adm["arms"][arm]["prefix_hit_tokens_per_round"] == full, adm["arms"][arm]
        assert adm["arms"][arm]["median_us_per_request"] > 0
        # R33: the four 63-page hits adopt their pages, so none waits for
        # staging (68 blocks here: before R33 one request per step)
        assert adm["arms"][arm]["steps_per_round"] == 1, adm["arms"][arm]
    stats = adm["arms"]["on"]["stats"]
    # HiSparse: the cached GPU pages are adopted each round, nothing is lost
    assert stats["pages_adopted"] >= 2 * 4 * (4096 // 64 - 1)
    assert stats["lost_pages"] == 0 and stats["staging_deferrals"] == 0
    assert adm["ratio_on_off"] > 0 and "stats" not in adm["arms"]["off"]


def test_an_arm_whose_pool_cannot_hold_its_requests_exits_with_why(tmp_path):
    """One request of 1000 tokens: on-hybrid's pool (the request's pages +
    30 blocks, shared by every resident and hot group) cannot hold its
    prompt, the pool a real engine's startup check refuses; the tool says
    so instead of stepping an idle scheduler forever."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench-scheduler"), "--requests", "1",
         "--steps", "2", "--prompt", "1000", "--admit", "0",
         "--json", str(tmp_path / "sched.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0
    assert "arm on-hybrid: 0 of 1 requests prefilled" in proc.stderr, proc.stderr[-2000:]
    assert "cannot hold them" in proc.stderr


def test_offload_arms_price_the_offloader_alone_and_beside_hisparse(tmp_path):
    """Issue 16 ("the OffloadingConnector composed beside it adds nothing
    when nothing is offloaded"), scheduler side: off-offload runs the pin's
    OffloadingConnector, on-offload the composed MultiConnector; both
    stored their prompts during the prefill and nothing while the timed
    steps decode (the pin offloads prompts only), and the report splits
    the offloader's own cost from the composition's."""
    out = tmp_path / "sched.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench-scheduler"), "--requests", "2",
         "--steps", "3", "--prompt", "200", "--admit", "0",
         "--arms", "off,on,off-offload,on-offload", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["arms"] == ["off", "on", "off-offload", "on-offload"]
    (run,) = report["runs"]
    arms = {a["arm"]: a for a in run["arms"]}
    assert list(arms) == report["arms"]
    for name in ("off-offload", "on-offload"):
        # one store job per request for its three full prompt pages
        assert arms[name]["offloader_stores"] == {"prefill": 2, "timed": 0}, arms[name]
    assert "offloader_stores" not in arms["on"]
    cost = run["offload"]
    median = {name: a["median_step_us"] for name, a in arms.items()}
    assert cost["alone_us"] == median["off-offload"] - median["off"]
    assert cost["composition_us"] == (
        cost["beside_hisparse_us"] - cost["alone_us"])


def test_arms_must_start_with_off():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench-scheduler"), "--arms", "on,off"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--arms: off first" in proc.stderr
