"""The held-out loss during training (`train.heldout_every`): the run's own unseen windows, scored as `lctrain eval`
scores perplexity, by the training engine itself every few steps.

The windows are those `lctrain eval` holds out (`eval.perplexity.heldout_rows`: the prepared windows outside what
`train.steps` reads, up to `eval.ppl_windows`), and the rule is its rule: plain causal attention over each whole
window, positions 0..L-1, whatever mask the run trains with, targets without the anchors (`heldout_batch`). So the
number is comparable between attention modes (a document mask would give each mode its own context), and at a step
with an export it is the perplexity `lctrain eval` reports for that export, in the run's dtype.

Each data-parallel replica scores its share of the windows (a sequence-parallel group each window's slices); every
replica runs as many forward passes as the largest share, so that ZeRO-3's collectives meet, a replica short of
windows scoring one again uncounted. The sums of the targets' losses and their count are reduced over all ranks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lctrain.attention import Batch, make_batch
from lctrain.attention.modes import shifted_labels

# the attention mode of the held-out score: every target sees its whole window before it, as at inference
SCORED_MODE = "full"


def heldout_batch(window: dict) -> Batch:
    """One window of the prepared data (`PackedData[i]`) as the `Batch` of its held-out score: the full causal mask,
    and the training's labels without the anchor targets (`shifted_labels` with `anchor_targets=False`), which
    leaves only text predictable from text."""
    ids = torch.as_tensor(window["input_ids"], dtype=torch.long)[None]
    rows = {k: [window[k]] for k in ("seg_lens", "seg_doc", "tag_lens")}
    batch = make_batch(ids, rows["seg_lens"], SCORED_MODE, seg_doc=rows["seg_doc"], tag_lens=rows["tag_lens"])
    return replace(batch, labels=shifted_labels(ids, batch.segments.layout, anchor_targets=False))


def replica_rows(rows: list[int], dp: int, dp_rank: int) -> list[tuple[int, bool]]:
    """The windows replica `dp_rank` of `dp` scores, each with whether it counts: `rows` dealt round-robin, and
    every replica given as many as the first (uncounted repeats of its own, or of the first window, fill a share)."""
    share = [r for i, r in enumerate(rows) if i % dp == dp_rank]
    passes = math.ceil(len(rows) / dp)
    filler = share[0] if share else rows[0]
    return [(r, True) for r in share] + [(filler, False)] * (passes - len(share))


class HeldoutLoss:
    """The mean held-out loss of a run's `rows` of `packed`, on every rank of `topo` (its `layout` deals them)."""

    def __init__(self, packed, rows: list[int], topo):
        self.packed, self.topo = packed, topo
        self.mine = replica_rows(rows, topo.layout.dp, topo.layout.dp_rank(topo.rank))

    def __call__(self, engine) -> tuple[float, int]:
        """(the mean loss over the held-out targets, their count): a forward pass per window of this rank's share."""
        topo = self.topo
        totals = torch.zeros(2, dtype=torch.float64, device=topo.device)
        with torch.no_grad():
            for row, counted in self.mine:
                batch = heldout_batch(self.packed[row]).shard(topo.sp, topo.sp_rank)
                loss_sum = engine(batch.to(topo.device))
                if counted:
                    totals[0] += loss_sum.double()
                    totals[1] += batch.valid_labels()
        if torch.distributed.is_initialized():  # training's always is (DeepSpeed's, of one process too)
            torch.distributed.all_reduce(totals)
        count = int(totals[1].item())
        return totals[0].item() / max(count, 1), count
