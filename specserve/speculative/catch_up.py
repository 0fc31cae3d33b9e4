"""The catch-up of one drafter of the speculative worker: before a row speculates with a
drafter whose state went stale (plain steps, or cycles of another drafter ran past what it
covers), the target's features at the missed positions come from a forward over them that
writes no KV (it is in the cache already), then Proposer.extend over them.

After a long stretch of plain steps under load the missed positions add up to a prefill's
worth (256 rows x 50 tokens): the forwards go in pieces of at most `budget` tokens (the
scheduler's token budget, what the activation memory was sized for), a row split between
pieces in position order (each piece's draft KV is written before the next reads it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from specserve.speculative.draft_state import DraftState
from specserve.worker.forward_batch import build_attention_metadata
from specserve.worker.step_input import StepInput
from specserve.worker.token_graphs import page_array


def pieces(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Forwards of at most `budget` tokens over rows of `lengths` missed positions each, in
    row order: per forward, (row, first, end) ranges of those positions."""
    assert budget >= 1
    out: list[list[tuple[int, int, int]]] = [[]]
    room = budget
    for row, n in enumerate(lengths):
        a = 0
        while a < n:
            if not room:
                out.append([])
                room = budget
            b = min(n, a + room)
            out[-1].append((row, a, b))
            room -= b - a
            a = b
    return [p for p in out if p]


def catch_up(worker, d: DraftState, rows: StepInput, budget: int) -> Iterator[
        tuple[str, torch.Tensor, int, int, bool]]:
    """(request id, new state row, positions covered, positions caught up over, whether the
    row is caught up to its root) per piece of a row of `rows` that needed it. worker:
    SpecWorker (its runner and the drafter's feature view)."""
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
    tokens = rows.token_ids.tolist()
    # the token after each missed position: the next missed one, the root after the last
    after = [m[1:] + [tokens[j]] for m, j in zip(missed, need)]
    view = worker.views.get(d.method)
    for piece in pieces([len(m) for m in missed], budget):
        feats = None
        if view is not None:
            feats = _graphed_features(runner, view, piece, starts, missed, pages)
        if view is not None and feats is None:
            md = build_attention_metadata(
                [b - a for _, a, b in piece], [starts[r] + b for r, _, b in piece],
                [pages[r] for r, _, _ in piece], runner.page_size, runner.device
            )
            md = dataclasses.replace(md, slot_mapping=torch.full_like(md.slot_mapping, -1))
            ids = [t for r, a, b in piece for t in missed[r][a:b]]
            positions = [starts[r] + i for r, a, b in piece for i in range(a, b)]
            view.enable()
            runner.forward(runner.tensor(ids), runner.tensor(positions), md)
            feats = view.pop()
            view.disable()
        new = d.proposer.extend([starts[r] + a for r, a, _ in piece],
                                [pages[r] for r, _, _ in piece],
                                [after[r][a:b] for r, a, b in piece], feats)
        for i, (r, a, b) in enumerate(piece):
            yield rids[r], new[i], starts[r] + b, b - a, b == len(missed[r])


def _graphed_features(runner, view, piece: list[tuple[int, int, int]], starts: list[int],
                     missed: list[list[int]], pages: list[list[int]]) -> torch.Tensor | None:
    """The piece's features through the runner's token graphs (the features variant, no KV
    written), or None where none holds the piece."""
    graphs = getattr(runner, "token_graphs", None)
    if graphs is None or not graphs.has("features"):
        return None
    ids = np.array([t for r, a, b in piece for t in missed[r][a:b]], dtype=np.int64)
    positions = np.array([starts[r] + i for r, a, b in piece for i in range(a, b)],
                         dtype=np.int64)
    q_lens = np.array([b - a for _, a, b in piece], dtype=np.int64)
    seq_lens = np.array([starts[r] + b for r, _, b in piece], dtype=np.int64)
    table = page_array([pages[r] for r, _, _ in piece], runner.spare_page)
    outs = graphs.run(ids, positions, q_lens, seq_lens, table, "features", write_kv=False)
    return None if outs is None else view.select(outs[1])
