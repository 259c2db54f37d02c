# SPDX-License-Identifier: Apache-2.0
"""The e2e gate's chat_chain on the CPU (R5; e2e runs 20-23): four
conversations whose follow-ups extend their parents' decoded pages, three
rounds, each after fillers that push every page out of the GPU pool, so each
follow-up loads its indexer prefix from the OffloadingConnector and reads its
sparse-MLA prefix from the host pool. The rig checks every indexer row read,
store and load against the tokens it encodes (sim_offload), under sync and
async scheduling (the byte model knows the token an async forward runs)."""

import random

import pytest

from tests.hisparse.offloading.test_offloading import offloaded_pages
from tests.hisparse.scheduler.harness import B, AsyncDriver, make_request
from tests.hisparse.scheduler.invariants import check_invariants

MAX_STEPS = 20_000


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 900) for _ in range(n)]


class ChatChain:
    def __init__(self, rig, num_gpu_blocks: int, async_scheduling: bool, seed: int = 0,
                 spec_name: str = "CPUOffloadingSpec", **offload_extra):
        self.rng = random.Random(seed)
        self.seed = seed
        self.r = rig(num_gpu_blocks=num_gpu_blocks, num_host_blocks=600,
                     num_cpu_blocks=1500, max_num_seqs=4, max_model_len=4096,
                     max_num_batched_tokens=512, async_scheduling=async_scheduling,
                     spec_name=spec_name, offload_extra=offload_extra)
        self.driver = (
            AsyncDriver(self.r.scheduler, self.r.worker) if async_scheduling else None
        )
        self.loads_per_round: list[int] = []
        self.host_prefix_pages: list[list[int]] = []
        self.offloaded_pages: list[list[int]] = []
        self.parent_prompts: list[int] = []
        self.preemptions = 0
        preempt = self.r.scheduler._preempt_request

        def counted(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        self.r.scheduler._preempt_request = counted

    def _busy(self) -> bool:
        if self.driver is not None:
            return self.driver.busy()
        s = self.r.scheduler
        return s.has_unfinished_requests() or s.connector.has_pending_push_work()

    def run(self, reqs) -> None:
        for q in reqs:
            self.r.scheduler.add_request(q)
        for _ in range(MAX_STEPS):
            if not self._busy():
                break
            (self.driver or self.r).step()
            check_invariants(self.r.scheduler)
        stuck = [(q.request_id, q.status.name) for q in reqs if not q.is_finished()]
        assert not stuck, f"requests never finished: {stuck}"

    def play(self, rounds: int = 3) -> None:
        firsts = [self.rng.randint(700, 1500) + 37 for _ in range(4)]
        reqs = [make_request(f"h{i}.0", _prompt(n, 100 * self.seed + i), 80)
                for i, n in enumerate(firsts)]
        self.run(reqs)
        history = {i: list(q.all_token_ids) for i, q in enumerate(reqs)}
        for rnd in range(1, rounds + 1):
            for k in range(3):  # fillers: every page leaves the GPU pool
                self.run([make_request(f"g{rnd}.{k}", _prompt(2500, 7000 + 3 * rnd + k), 16)])
            probes = [make_request(f"p{rnd}.{i}", history[i] + [5], 1) for i in range(4)]
            self.host_prefix_pages.append(
                [self.r.hisparse.host_prefix_tokens(p) // B for p in probes])
            self.offloaded_pages.append([offloaded_pages(self.r, p) for p in probes])
            self.parent_prompts = [q.num_prompt_tokens for q in reqs]
            before = self.r.offload.loads_verified
            turns = [_prompt(self.rng.randint(150, 400), 31 * rnd + i) for i in range(4)]
            reqs = [make_request(f"h{i}.{rnd}", history[i] + turns[i], 80) for i in range(4)]
            self.run(reqs)
            self.loads_per_round.append(self.r.offload.loads_verified - before)
            history = {i: list(q.all_token_ids) for i, q in enumerate(reqs)}


@pytest.mark.parametrize("spec_name", ["CPUOffloadingSpec", "TieringOffloadingSpec"])
@pytest.mark.parametrize("prompt_only", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_follow_ups_load_their_history_exactly(rig, async_scheduling, prompt_only,
                                               spec_name):
    """R5 / INV-31: every round's follow-ups load an offloaded indexer prefix
    (their parent's prompt, which holds the earlier turns' answers, or with
    decoded pages offloaded their whole history; the host prefix grows by
    each turn), and every row read, store and load is exact. Also with the
    blog's tiering spec (the gate's and the soak's), whose manager forgets a
    finished request (K34)."""
    chain = ChatChain(rig, num_gpu_blocks=400, async_scheduling=async_scheduling,
                      offload_prompt_only=prompt_only, spec_name=spec_name)
    chain.play()
    assert chain.loads_per_round == [4, 4, 4]
    grown = [b > a for a, b in zip(chain.host_prefix_pages[0], chain.host_prefix_pages[-1])]
    assert all(grown), chain.host_prefix_pages
    r = chain.r
    assert r.offload.indexer_reads_checked > 0 and r.worker.reads_checked > 0
    r.finish()


@pytest.mark.parametrize("prompt_only", [True, False])
def test_which_decoded_pages_the_offloader_holds(rig, prompt_only):
    """R5 / K28 (runs 20-23): with the pin's default (offload_prompt_only) a
    parent's decoded pages never reach the offloader: it holds each
    conversation only up to the last full page of the prompt, so a
    follow-up recomputes the parent's decoded pages as prompt and the next
    follow-up loads that version (the off arm reuses the decoded one; the
    kernels are not batch invariant). Offloading decoded pages, as the
    gate's arms do, holds every full page the host prefix has."""
    chain = ChatChain(rig, num_gpu_blocks=400, async_scheduling=False,
                      offload_prompt_only=prompt_only)
    chain.play(rounds=1)
    held, host = chain.offloaded_pages[0], chain.host_prefix_pages[0]
    prompt_pages = [n // B for n in chain.parent_prompts]
    if prompt_only:
        assert held == prompt_pages and all(h < p for h, p in zip(held, host))
    else:
        assert held == host
    chain.r.finish()


@pytest.mark.parametrize("num_gpu_blocks", [200, 240, 300])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_follow_ups_returning_together_under_pressure_all_finish(
    rig, num_gpu_blocks, async_scheduling
):
    """R4 / F20 (docs/worker.md K33): four follow-ups return together, each
    admitted for an async offloaded load. Each admission must fit its whole
    sequence beside the others' reservations, not only its first chunk:
    before the fix (patch core-scheduler-wait-for-in-flight-blocks) the
    fourth was admitted at 240 blocks, the reservations outgrew the pool and
    the loaded head waited for blocks the loads behind it held, forever."""
    chain = ChatChain(rig, num_gpu_blocks=num_gpu_blocks, async_scheduling=async_scheduling)
    chain.play()
    assert sum(chain.loads_per_round) >= 3 * 2  # offloaded prefixes were used
    r = chain.r
    assert r.hisparse.stats.lost_pages > 0  # under pressure
    assert chain.preemptions == 0
    r.finish()
