"""The catch-up of one drafter of the speculative worker: before a row speculates with a
drafter whose state went stale (plain steps, or cycles of another drafter ran past what it
covers), the target's features at the missed positions come from a forward over them that
writes no KV (it is in the cache already), then Proposer.extend over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from specserve.speculative.draft_state import DraftState
from specserve.worker.forward_batch import build_attention_metadata
from specserve.worker.step_input import StepInput


def catch_up(worker, d: DraftState, rows: StepInput) -> Iterator[tuple[str, torch.Tensor, int,
                                                                       int]]:
    """(request id, new state row, positions covered, positions caught up over) per row of
    `rows` that needed it. worker: SpecWorker (its runner and the drafter's feature view)."""
    if not d.keeps_state:
        return
    need = [j for j in range(rows.bs) if d.pending.get(rows.request_ids[j])]
    if not need:
        return
    runner = worker.runner
    rids = [rows.request_ids[j] for j in need]
    starts = [d.covered[rid] for rid in rids]
    missed = [d.pending[rid] for rid in rids]
    pages = rows.select(need).page_lists()
    roots = [int(rows.starts[j]) for j in need]
    feats = None
    view = worker.views.get(d.method)
    if view is not None:
        md = build_attention_metadata(
            [len(m) for m in missed], roots, pages, runner.page_size, runner.device
        )
        md = dataclasses.replace(md, slot_mapping=torch.full_like(md.slot_mapping, -1))
        positions = [a + i for a, m in zip(starts, missed) for i in range(len(m))]
        view.enable()
        runner.forward(
            runner.tensor([t for m in missed for t in m]), runner.tensor(positions), md
        )
        feats = view.pop()
        view.disable()
    tokens = rows.token_ids.tolist()
    nxt = [m[1:] + [tokens[j]] for m, j in zip(missed, need)]
    new = d.proposer.extend(starts, pages, nxt, feats)
    for j, rid in enumerate(rids):
        yield rid, new[j], roots[j], len(missed[j])
