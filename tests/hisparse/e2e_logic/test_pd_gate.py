# SPDX-License-Identifier: Apache-2.0
"""The gate's P/D flow (tests/e2e/run_e2e.py: off_pd, pd_prefill, on_pd,
rep_pd; spec 4.13, INV-30, target T1) end to end on CPU with the FakeLLM of
test_gate_flow.py, taught P/D: a producer writes one folder per prompt
(its chunk count, which the imported KV's low bits carry) under its
shared_storage_path; a consumer finding a prompt's folder computes only
the tail, and HiSparse's counts a device landing for short prompts and a
host landing for long ones. Each verdict is shown to pass and to fail."""

import hashlib
import json
from pathlib import Path

import pytest
import run_e2e as e2e
import torch

from tests.hisparse.e2e_logic.test_gate_flow import FakeLLM, entry

PD = "off_pd,pd_prefill,on_pd,rep_pd"
HOST_FROM = 5000
"""Fake landing rule: a prompt this long lands host-only, shorter ones on
the device (the real rule is simulate_pd's)."""


class PDFakeLLM(FakeLLM):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        ktc = kw.get("kv_transfer_config")
        self.role = getattr(ktc, "kv_role", None)
        self.store = (Path(ktc.kv_connector_extra_config["shared_storage_path"])
                      if ktc is not None and ktc.kv_connector_extra_config.get(
                          "shared_storage_path") else None)
        if self.hisparse:
            self.stats().__dict__.update(import_device_pages=0, import_host_pages=0,
                                         import_fallbacks=0)
        self.imported: dict[str, int] = {}

    def folder(self, prompt) -> Path:
        return self.store / hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()

    def enqueue(self, prompts, params, use_tqdm=False):
        ids = super().enqueue(prompts, params, use_tqdm)
        if self.role != "kv_consumer":
            return ids
        waiting = {r.request_id: r for r in self.scheduler().waiting}
        for rid, p in zip(ids, prompts):
            folder = self.folder(p["prompt_token_ids"])
            if not folder.is_dir():
                continue
            n = len(p["prompt_token_ids"])
            t = (n - 2) // 64 * 64  # file_tokens
            waiting[rid].left, waiting[rid].hit_tokens = n - t, t
            self.imported[rid.split("-")[0]] = int((folder / "chunks").read_text())
            if self.hisparse:
                which = "import_host_pages" if n >= HOST_FROM else "import_device_pages"
                if not self.skew.get("no_host") or which == "import_device_pages":
                    setattr(self.stats(), which, getattr(self.stats(), which) + t // 64)
        return ids

    def output(self, rid, prompt, sp, chunks=1):
        out = super().output(rid, prompt, sp, chunks)
        if self.role == "kv_producer" and not self.skew.get("no_save"):
            folder = self.folder(prompt)
            folder.mkdir()
            (folder / "chunks").write_text(str(chunks))
        produced = self.imported.pop(rid, None)
        if produced is not None:
            # the imported KV carries the producer's batches in its low bits
            for pos in out.outputs[0].logprobs:
                for lp in pos.values():
                    lp.logprob -= produced * 2 ** -26
        return out


@pytest.fixture
def pd_gate(tmp_path, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", PDFakeLLM, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "cpu")
    monkeypatch.setattr(e2e, "make_models", lambda stage: {"glm": stage / "g"})
    monkeypatch.setattr(e2e, "shutdown", lambda llm: None)

    def run(engines=PD, **skew):
        FakeLLM.skew = skew
        out = tmp_path / "out"
        stale = out / e2e.PD_DIR / "stale"
        stale.mkdir(parents=True, exist_ok=True)  # a previous run's folder
        args = e2e.parse_args(["--out", str(out), "--stage", str(tmp_path),
                               "--engines", engines])
        seen = []
        make = e2e.Gate.run_engine

        def run_engine(self, name):  # the folder as each engine found it
            seen.append(sorted(p.name for p in self.pd_dir.iterdir())
                        if self.pd_dir.is_dir() else None)
            return make(self, name)

        monkeypatch.setattr(e2e.Gate, "run_engine", run_engine)
        rc = e2e.Gate(args).run()
        R = json.loads((out / "e2e.json").read_text())
        R.update(json.loads((out / "e2e_records.json").read_text()))
        assert not (out / e2e.PD_DIR).exists()  # removed at the end
        return rc, R, seen

    return run


def test_a_pd_run_passes_by_its_replay_with_its_negative_control(pd_gate):
    """4.13 / T1: the producer wrote every prompt (1 token each) into a
    folder emptied first; on_pd imported them (both landings) and its
    replay over the same files is bitwise; off_pd, computing the prompts
    itself, agrees in tokens only (reported); the fault on an imported
    host-landed page is detected; the files are removed at the end."""
    rc, R, seen = pd_gate()
    assert rc == 0, R["failures"]
    # the stale folder was there until the producer started, not after
    assert "stale" in seen[1] and "stale" not in seen[2] and len(seen[2]) > 0
    assert R["pd_files"]["folders"] == len(seen[3]) and R["pd_files"]["bytes"] > 0
    for scenario in e2e.ON_PLAN["on_pd"]:
        saved = entry(R, "pd_prefill", scenario)["pd_saved"]
        assert saved["folders"] == saved["requests"] > 0
        assert {len(r["tokens"]) for r in R["records"][f"pd_prefill/{scenario}"].values()} == {1}
    e = entry(R, "on_pd", "pd_imports")
    assert e["pass"] and e["decided_by"] == "replay" and e["replay"]["bitwise_logprobs"]
    assert all(e["checks"].values()) and set(e["checks"]) >= {"imported_to_device",
                                                            "imported_to_host"}
    natural = e["comparison"]
    assert natural["identical_tokens"] and not natural["bitwise_logprobs"]
    assert not natural["schedule_equal"]
    assert {len(r["tokens"]) for r in R["records"]["on_pd/pd_imports"].values()} == {64}
    nc = entry(R, "on_pd", "fault_probe")["negative_control"]
    assert nc["pass"] and nc["detected"] and R["negative_control_detected"] is True


def test_a_consumer_without_a_host_landing_fails(pd_gate):
    rc, R, _ = pd_gate(no_host=True)
    e = entry(R, "on_pd", "pd_imports")
    assert rc == 1 and e["replay"]["bitwise_logprobs"] and not e["pass"]
    assert e["checks"]["imported_to_device"] and not e["checks"]["imported_to_host"]


def test_a_producer_that_saved_nothing_fails(pd_gate):
    """Nothing to import: the producer's check and the consumer's fail."""
    rc, R, _ = pd_gate(no_save=True)
    assert rc == 1
    assert any("pd_prefill/pd_imports: the producer saved" in f for f in R["failures"])
    checks = entry(R, "on_pd", "pd_imports")["checks"]
    assert not checks["imported_to_device"] and not checks["imported_to_host"]


def test_the_replay_needs_the_same_files(pd_gate, monkeypatch):
    """T1: only a consumer of the producer's files can be bitwise: a replay
    arm computing the prompts itself (no connector) runs other batches and
    fails the scenario."""
    specs = e2e.engine_specs()
    specs["rep_pd"] = dict(specs["rep_pd"], pd=None)
    monkeypatch.setattr(e2e, "engine_specs", lambda: specs)
    rc, R, _ = pd_gate()
    e = entry(R, "on_pd", "pd_imports")
    assert rc == 1 and not e["pass"] and not e["replay"]["pass"]

