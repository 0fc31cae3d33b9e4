"""Per-request draft state of the speculative worker: which positions each request's proposer
covers, its state row, and the tokens plain steps ran past them (speculative/worker.py's
module docstring has the positions). `DraftStates` is a part of `SpecWorker`: it reads the
worker's proposer, runner, capture and counters, and keeps

    state    request id -> the proposer's state row after position covered - 1
    covered  request id -> positions [0, covered) the proposer covers (its KV is in the pages)
    pending  request id -> tokens plain steps ran past `covered` (host ints), until the
             catch-up: one target forward over them that writes no KV gives the features,
             then Proposer.extend
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specserve.speculative.proposer import DraftShape
from specserve.worker.forward_batch import build_attention_metadata
from specserve.worker.step_input import StepInput


class DraftStates:
    state: dict[str, torch.Tensor]
    covered: dict[str, int]
    pending: dict[str, list[int]]

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)
        self.covered.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.proposer.release(request_id)

    def release_all(self) -> None:
        ids = set(self.covered)
        if self.host_drafts:  # a state-free proposer keeping host history of its own
            ids |= set(self.proposer.requests)
        for rid in sorted(ids):
            self.release(rid)

    def _reachable(self, rid: str, start: int) -> bool:
        """The proposer covers [0, start) with its state row, or can be caught up to it (a
        request admitted on a cached prefix covers it with no state row: its first chunk,
        even a single token, runs as a plain row that feeds the proposer)."""
        if not self.proposer.keeps_state:
            return True
        covered, pending = self.covered.get(rid), self.pending.get(rid, ())
        return (
            covered is not None
            and covered + len(pending) == start
            and (bool(pending) or rid in self.state)
        )

    def _record(self, rows: StepInput, index: list[int] | range) -> None:
        """Rows run by the target without feeding the proposer: remember their tokens past
        its covered prefix, for the catch-up (a request first seen mid-way stays plain)."""
        if not self.proposer.keeps_state:
            return
        ids, starts = rows.request_ids, rows.starts.tolist()
        tokens, off = rows.token_ids.tolist(), rows.tok_off.tolist()  # host lists: one pass
        covered_of, pending_of = self.covered, self.pending
        for r in index:
            rid, start = ids[r], starts[r]
            covered = covered_of.get(rid)
            if covered is None:
                if start:
                    continue
                covered = covered_of[rid] = 0
            pending = pending_of.get(rid)
            if pending is None:
                pending = pending_of[rid] = []
            if covered + len(pending) != start:  # not contiguous: nothing to catch up from
                self.release(rid)
                continue
            pending.extend(tokens[off[r]:off[r + 1]])

    def _restore_cached(self, step: StepInput) -> None:
        """Rows admitted on a cached prefix: the draft KV of [0, start) is in their pages."""
        if not self.proposer.keeps_state:
            return
        for r in np.flatnonzero(step.from_cache).tolist():
            rid = step.request_ids[r]
            self.release(rid)
            self.covered[rid] = int(step.starts[r])

    def _draft_computed(self, step: StepInput) -> list[int] | None:
        """Per row: positions whose draft KV is valid now (None: no draft KV in the pages)."""
        if not self.proposer.keeps_state:
            return None
        return [self.covered.get(rid, 0) for rid in step.request_ids]

    def _states(self, rows: StepInput, shape: DraftShape) -> torch.Tensor:
        request_ids = rows.request_ids
        if self.host_drafts:
            return self.proposer.host_states(shape, rows)
        if self.proposer.state_dim == 0:
            return torch.zeros(
                len(request_ids), 0, dtype=self.proposer.state_dtype, device=self.runner.device
            )
        return torch.stack([self.state[rid] for rid in request_ids])

    def _set_state(self, rid: str, row: torch.Tensor, covered: int) -> None:
        if self.proposer.keeps_state:
            self.state[rid] = row
            self.covered[rid] = covered
            self.pending.pop(rid, None)

    def _caught_up(self, rid: str, start: int) -> bool:
        covered = self.covered.get(rid, 0 if start == 0 else None)
        return covered == start and not self.pending.get(rid)

    def _catch_up(self, rows: StepInput) -> None:
        """Bring the proposer of rows whose state went stale during plain steps up to their
        root: the target's features at the missed positions come from a forward over them
        that writes no KV (it is in the cache already), then Proposer.extend."""
        if not self.proposer.keeps_state:
            return
        need = [j for j in range(rows.bs) if self.pending.get(rows.request_ids[j])]
        if not need:
            return
        runner = self.runner
        rids = [rows.request_ids[j] for j in need]
        starts = [self.covered[rid] for rid in rids]
        missed = [self.pending[rid] for rid in rids]
        pages = rows.select(need).page_lists()
        roots = [int(rows.starts[j]) for j in need]
        feats = None
        if self.capture is not None:
            md = build_attention_metadata(
                [len(m) for m in missed], roots, pages, runner.page_size, runner.device
            )
            md = dataclasses.replace(md, slot_mapping=torch.full_like(md.slot_mapping, -1))
            positions = [a + i for a, m in zip(starts, missed) for i in range(len(m))]
            self.capture.enable()
            runner.forward(
                runner.tensor([t for m in missed for t in m]), runner.tensor(positions), md
            )
            feats = self.capture.pop()
            self.capture.disable()
        nxt = [m[1:] + [int(rows.token_ids[j])] for m, j in zip(missed, need)]
        new = self.proposer.extend(starts, pages, nxt, feats)
        for j, rid in enumerate(rids):
            self._set_state(rid, new[j], roots[j])
        self.counters.num_catch_ups += len(rids)
        self.counters.num_catch_up_tokens += sum(len(m) for m in missed)
