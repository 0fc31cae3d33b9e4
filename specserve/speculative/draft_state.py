"""Per-request draft state of one proposer of the speculative worker: which positions each
request's proposer covers, its state row, and the tokens steps it did not draft ran past them
(speculative/worker.py's module docstring has the positions). The worker holds one
`DraftState` per proposer (a primary drafter plus extra model-free ones); each keeps

    state    request id -> the proposer's state row after position covered - 1
    covered  request id -> positions [0, covered) the proposer covers (its KV is in the pages)
    pending  request id -> tokens run past `covered` by plain steps or by another proposer's
             cycles (host ints), until the catch-up: one target forward over them that writes
             no KV gives the features, then Proposer.extend (SpecWorker._catch_up)
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.speculative.proposer import DraftShape, Proposer
from specserve.worker.step_input import StepInput


class DraftState:
    def __init__(self, method: str, proposer: Proposer, device: torch.device) -> None:
        self.method, self.proposer, self.device = method, proposer, device
        self.keeps_state = bool(proposer.keeps_state)
        self.host_drafts = bool(getattr(proposer, "host_drafts", False))
        self.state: dict[str, torch.Tensor] = {}
        self.covered: dict[str, int] = {}
        self.pending: dict[str, list[int]] = {}

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)
        self.covered.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.proposer.release(request_id)

    def request_ids(self) -> set[str]:
        ids = set(self.covered)
        if self.host_drafts:  # a state-free proposer keeping host history of its own
            ids |= set(self.proposer.requests)
        return ids

    def reachable(self, rid: str, start: int) -> bool:
        """The proposer covers [0, start) with its state row, or can be caught up to it (a
        request admitted on a cached prefix covers it with no state row: its first chunk,
        even a single token, runs as a plain row that feeds the proposer)."""
        if not self.keeps_state:
            return True
        covered, pending = self.covered.get(rid), self.pending.get(rid, ())
        return (
            covered is not None
            and covered + len(pending) == start
            and (bool(pending) or rid in self.state)
        )

    def append(self, rid: str, start: int, tokens: list[int]) -> None:
        """Target KV became valid at positions start .. start + len(tokens) - 1 (holding
        `tokens`) without this proposer seeing them: remember them for the catch-up (a
        request first seen mid-way, or a gap, leaves the proposer out for that request)."""
        covered = self.covered.get(rid)
        if covered is None:
            if start:
                return
            covered = self.covered[rid] = 0
        pending = self.pending.get(rid)
        if pending is None:
            pending = self.pending[rid] = []
        if covered + len(pending) != start:  # not contiguous: nothing to catch up from
            self.release(rid)
            return
        pending.extend(tokens)

    def record(self, rows: StepInput, index: list[int] | range) -> None:
        """Rows run by the target without feeding the proposer."""
        if not self.keeps_state:
            return
        ids, starts = rows.request_ids, rows.starts.tolist()
        tokens, off = rows.token_ids.tolist(), rows.tok_off.tolist()  # host lists: one pass
        covered, pending = self.covered, self.pending
        for r in index:
            rid, start = ids[r], starts[r]
            cov, pend = covered.get(rid), pending.get(rid)
            if cov is not None and pend is not None and cov + len(pend) == start:
                pend += tokens[off[r]:off[r + 1]]  # append()'s common case, inline
            else:
                self.append(rid, start, tokens[off[r]:off[r + 1]])

    def restore_cached(self, step: StepInput) -> None:
        """Rows admitted on a cached prefix: the draft KV of [0, start) is in their pages."""
        if not self.keeps_state:
            return
        for r in np.flatnonzero(step.from_cache).tolist():
            rid = step.request_ids[r]
            self.release(rid)
            self.covered[rid] = int(step.starts[r])

    def states(self, rows: StepInput, shape: DraftShape) -> torch.Tensor:
        if self.host_drafts:
            return self.proposer.host_states(shape, rows)
        if self.proposer.state_dim == 0:
            return torch.zeros(rows.bs, 0, dtype=self.proposer.state_dtype, device=self.device)
        return torch.stack([self.state[rid] for rid in rows.request_ids])

    def set_state(self, rid: str, row: torch.Tensor, covered: int) -> None:
        if self.keeps_state:
            self.state[rid] = row
            self.covered[rid] = covered
            self.pending.pop(rid, None)

    def caught_up(self, rid: str, start: int) -> bool:
        covered = self.covered.get(rid, 0 if start == 0 else None)
        return covered == start and not self.pending.get(rid)
