# SPDX-License-Identifier: Apache-2.0
"""P2: what a steady no-pressure decode step costs outside the forward.

At no pressure every request is all-resident, and a pure-decode step's
HiSparse work outside the (graph-captured) forward must stay a fixed handful
of launches: none on CPU (on the GPU the step inputs' one host-to-device
copy, and only when they changed). The row mirror (K5b, K5) runs in
the forward, after the last target layer's attention, where a FULL graph
captures it. Every extra eager torch op is host time on each decode step
(run 3 of results/tax: the tax is host time), so this guard counts the real
worker's ``start_step`` and ``finish_forward`` through torch's dispatcher,
and the attention calls' launches apart, with the kernels counted as one
launch each.
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from worker_harness import WorkerRig, attn_metadata

# Ops that launch nothing on the device (views and autograd bookkeeping).
_NO_LAUNCH = {"aten.slice.Tensor", "aten.detach.default", "aten.view.default",
              "aten.select.int", "aten.unsqueeze.default", "aten.alias.default",
              "aten.as_strided.default"}


class _Launches(TorchDispatchMode):
    """Counts the eager ops and HiSparse kernels issued while ``on``; a
    kernel's CPU reference counts as one launch, not as its torch ops."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.on = False
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.on and not self.inside_kernel and name not in _NO_LAUNCH:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, name, fn):
        def launch(*args, **kwargs):
            if self.on and not self.inside_kernel:
                self.counts[f"kernel:{name}"] += 1
            self.inside_kernel += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_kernel -= 1
        return launch


def _counting_rig(counter: _Launches) -> WorkerRig:
    rig = WorkerRig()
    ops = rig.rt.ops
    rig.rt.ops = type("CountedOps", (), {
        name: staticmethod(counter.kernel(name, getattr(ops, name)))
        for name in dir(ops) if not name.startswith("_") and callable(getattr(ops, name))
    })
    return rig


def _decode_step(rig: WorkerRig, counter: _Launches,
                 rows: int) -> collections.Counter:
    """One decode step; ``counter`` counts start_step and finish_forward.
    Returns the launches of the attention calls (the forward's part)."""
    rig.batch.schedule(computed=[100] * rows, scheduled=[1] * rows)
    md = attn_metadata(rig.batch, rows, rows)
    meta = rig.meta()
    counter.on = True
    rig.worker.start_step(meta, md)
    counter.on = False
    # The forward: captured in a graph in the FULL modes, counted apart.
    topk = torch.arange(64, dtype=torch.int32).repeat(rows, 1) + 37
    for layer in rig.layout.sparse_layers:
        rig.rt.decode_rows(layer, rows, topk, md.seq_lens, md.block_table)
    outside, counter.counts = counter.counts, collections.Counter()
    counter.on = True
    rig.attend(md)
    counter.on = False
    in_forward, counter.counts = counter.counts, outside
    counter.on = True
    rig.worker.finish_forward()
    counter.on = False
    return in_forward


def test_a_steady_all_resident_decode_step_launches_a_fixed_handful():
    """P2 (issue 16 item 1): batch 4, every page resident, third step (the
    first two may set things up). Outside the forward: nothing, whatever
    the batch or layer count (on the GPU StepInputs' host-to-device copy
    when the inputs changed; on CPU its tensor is its own host buffer). In
    the forward's attention calls: K5b and K5 once, after the last
    layer's."""
    counter = _Launches()
    with counter:
        rig = _counting_rig(counter)
        for row in range(4):
            rig.place(row, resident=[3 + 2 * row, 4 + 2 * row],
                      host=[40 + 2 * row, 41 + 2 * row])
        _decode_step(rig, counter, 4)
        _decode_step(rig, counter, 4)
        counter.counts.clear()
        in_forward = _decode_step(rig, counter, 4)
    assert rig.rt.stats()["misses"] == 0
    assert dict(counter.counts) == {}
    assert dict(in_forward) == {
        "kernel:mirror_descriptors": 1,   # K5b: the step's copy descriptors
        "kernel:copy_descriptors": 1,     # K5: the eager host mirror
    }
