"""SpecWorker: one speculative engine step for any proposer (speculative/proposer.py).

Positions, for a running request whose root (last emitted token, KV not yet computed) sits at
target position P:
    target KV  covers [0, P)          the verify forward writes P .. P+n-1 (node i at P + i);
                                      the accepted path is then compacted to P .. P+m-1
    proposer   covers [0, covered)    covered == P when caught up; its state row is the one
                                      after position P - 1
Each step, per row (StepInput.speculate says which rows may speculate this step):
  - a decode that may speculate and whose proposer state covers [0, P), or can be caught up
    to it, runs one cycle (speculative/cycle.py, through CycleRunner: graphs, overlap);
  - every other row runs a plain target forward; a prefill chunk that may speculate and
    whose state is caught up also feeds the proposer (with the target's aux features);
  - a step in which no row may speculate is the runner's plain step (decode graphs and decode
    overlap, no draft forward); the tokens it runs past each request's covered prefix are
    recorded (host ints), and before that request speculates again the proposer is caught
    up over them: one target forward that writes no KV (its KV is already there) gives the
    features, then `Proposer.extend`. The catch-up costs a prefill of the tokens made while
    off, paid once, and nothing while off.
Prefix caching: a row marked `from_cache` starts at the end of a cached prefix whose draft KV
is in the pages already (cached with the target's, under keys that cover it): the proposer
covers [0, start) at once and the row's chunk feeds it (or is caught up) like any other; its
state row comes from that chunk, which always runs at least one token. Every step reports how
far each row's draft KV is valid (`StepOutput.draft_computed`): the scheduler caches no page
past it.
The only device-to-host copy of a speculative step is the emitted tokens (plus the sampled
tokens of prefill chunks, when a step has any).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import SpecConfig
from specserve.models.capture import AuxHiddenCapture
from specserve.speculative.cycle import SpecCycle
from specserve.speculative.cycle_runner import CycleRunner
from specserve.speculative.draft_state import DraftStates
from specserve.speculative.proposer import DraftShape, Proposer, draft_shapes
from specserve.worker.logits import logprob_lists, prompt_logprobs, sample_logits
from specserve.worker.step_input import StepInput, StepOutput

log = logging.getLogger(__name__)


def _device_memory(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


@dataclass
class SpecCounters:
    """Totals with the meaning of vLLM's spec_decode metrics, plus mode and catch-up work."""

    num_drafts: int = 0  # draft-verify cycles
    num_draft_tokens: int = 0  # draft tokens proposed (root excluded)
    num_accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    accepted_per_pos: list[int] = field(default_factory=list)
    num_catch_ups: int = 0  # rows whose proposer caught up after plain steps
    num_catch_up_tokens: int = 0  # positions it caught up over
    mode_steps: dict[str, int] = field(default_factory=dict)  # steps per mode ("off": plain)


@dataclass
class DraftMode:
    """One draft shape with its cycle, its graphs and the slots it needs past the root."""

    shape: DraftShape
    lookahead: int  # slots past the root a decode must own: verify nodes and draft scratch
    cycle: SpecCycle
    cycles: CycleRunner


class SpecWorker(DraftStates):
    def __init__(self, spec: SpecConfig, runner, proposer: Proposer) -> None:
        self.spec = spec
        self.runner = runner  # ModelRunner
        self.proposer = proposer
        self.capture = None
        if proposer.needs_target_features:
            self.capture = AuxHiddenCapture(runner.model, list(proposer.aux_layer_ids))
            self.capture.disable()
        self.modes: dict[str, DraftMode] = {}
        t0, mem0 = time.perf_counter(), _device_memory(runner.device)
        for shape in draft_shapes(spec):
            lookahead = max(shape.num_draft_tokens, proposer.scratch_slots(shape)) - 1
            cycle = SpecCycle(runner, proposer, shape, lookahead, self.capture,
                              spec.synthetic_accept_len, spec.synthetic_accept_rate)
            cycles = CycleRunner(cycle, proposer.state_dim, proposer.state_dtype,
                                 spec.synthetic)
            self.modes[shape.name] = DraftMode(shape, lookahead, cycle, cycles)
        if self.num_graphs:
            log.info("speculative graphs: %d for modes %s in %.1f s, %.0f MiB of device memory",
                     self.num_graphs, ", ".join(self.modes), time.perf_counter() - t0,
                     (_device_memory(runner.device) - mem0) / 2**20)
        default = next(iter(self.modes.values()))  # the configured shape
        self.default_mode = default.shape.name
        self.shape, self.cycle, self.cycles = default.shape, default.cycle, default.cycles
        self.k, self.num_steps, self.n = (self.shape.topk, self.shape.num_steps,
                                          self.shape.num_draft_tokens)
        # admission and page reservations: the most any mode needs
        self.lookahead = max(m.lookahead for m in self.modes.values())
        max_steps = max(m.shape.num_steps for m in self.modes.values())
        self.counters = SpecCounters(accepted_per_pos=[0] * max_steps,
                                     mode_steps=dict.fromkeys(["off", *self.modes], 0))
        # per request id: the proposer's state row after position covered - 1, positions
        # covered, and (while stale) the tokens run past them
        self.state: dict[str, torch.Tensor] = {}
        self.covered: dict[str, int] = {}
        self.pending: dict[str, list[int]] = {}
        # a proposer whose trees the host builds from the previous cycle's tokens
        # (`host_drafts`, e.g. suffix decoding) cannot launch a cycle ahead: overlap off
        self.host_drafts = bool(getattr(proposer, "host_drafts", False))
        self.overlap = runner.overlap and not self.host_drafts
        if self.host_drafts:
            for m in self.modes.values():
                m.cycles.overlap = False
        # overlap: the next cycle is launched before this one is read; its requests keep the
        # slots it may write, up to W + lookahead past their valid KV
        self.keep_ahead = 0
        if self.overlap:
            self.keep_ahead = max(m.shape.width + m.lookahead for m in self.modes.values())

    # -- introspection -------------------------------------------------------------------------
    @property
    def graphs(self):
        """The configured mode's graphs (None where graphs are off)."""
        return self.cycles.graphs

    @property
    def num_graphs(self) -> int:
        return sum(m.cycles.num_graphs for m in self.modes.values())

    @property
    def cycles_launched(self) -> int:
        return sum(m.cycles.cycles_launched for m in self.modes.values())

    @property
    def cycles_launched_ahead(self) -> int:
        return sum(m.cycles.cycles_launched_ahead for m in self.modes.values())

    def lookahead_of(self, mode: str | None) -> int:
        return 0 if mode is None else self.modes[mode].lookahead

    def discard_launched(self, keep: DraftMode | None = None) -> None:
        for mode in self.modes.values():
            if mode is not keep:
                mode.cycles.discard_launched()

    def close(self) -> None:
        """Drop the cycle graphs and per-request state and unhook the target (idempotent)."""
        if self.capture is not None:
            self.capture.remove()
        self.state.clear()
        self.cycles = self.cycle = self.proposer = None  # type: ignore[assignment]

    def _can_speculate(self, step: StepInput, i: int, mode: DraftMode) -> bool:
        """A decode that may speculate, whose proposer covers [0, P) (or can be caught up)
        and whose pages hold the mode's verify nodes and draft scratch. A one-token prefill
        chunk (a prompt's last token after a cached prefix) is no decode: the scheduler
        reserved it no lookahead and takes one token from it, so it runs plain even where
        its page would hold the nodes and a state-free proposer could draft."""
        start = int(step.starts[i])
        return bool(
            step.speculate[i]
            and step.is_decode[i]
            and step.num_new_tokens[i] == 1
            and step.samples[i]
            and step.page_counts[i] * self.runner.page_size >= start + 1 + mode.lookahead
            and self._reachable(step.request_ids[i], start)
        )

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_ids + step.preempted_ids:
            self.release(rid)  # preempted: their KV is gone; re-prefill rebuilds the state
        self._restore_cached(step)
        mode = None
        if step.speculate.any():
            mode = self.modes.get(step.spec_mode)
            if mode is None:
                raise ValueError(f"draft mode {step.spec_mode!r} is not one of {list(self.modes)}")
        self.discard_launched(keep=mode)  # a launch ahead is only taken by its own mode
        if step.bs:
            self.counters.mode_steps["off" if mode is None else mode.shape.name] += 1
        if mode is None:  # off: the plain step, no draft forward
            self._record(step, range(step.bs))
            out = self.runner.execute(step)
            out.draft_computed = self._draft_computed(step)
            if self.host_drafts:
                self.proposer.observe(step, out.token_ids)
            return out
        self.runner.discard_launched()
        tokens: list[list[int]] = [[] for _ in range(step.bs)]
        computed = step.num_new_tokens.tolist()
        drafted = [0] * step.bs
        logprobs: list | None = [None] * step.bs if (step.logprobs >= 0).any() else None
        prompt_lps: list | None = [None] * step.bs if (step.prompt_logprobs >= 0).any() \
            else None
        decodes = [i for i in range(step.bs) if self._can_speculate(step, i, mode)]
        spec = set(decodes)
        others = [i for i in range(step.bs) if i not in spec]
        if others:
            self._target_rows(step.select(others), others, tokens, logprobs, prompt_lps)
        if decodes:
            rows = step.select(decodes)
            self._catch_up(rows)
            # requests finishing their prefill here speculate next step: no launch ahead
            joining = bool(step.samples[others].any()) if others else False
            emitted, new_state, lps = mode.cycles.speculate(
                rows, lambda: self._states(rows, mode.shape), launch_next=not joining
            )
            proposed = mode.shape.num_draft_tokens - 1
            for j, (i, rid) in enumerate(zip(decodes, rows.request_ids)):
                m = len(emitted[j])
                tokens[i], computed[i], drafted[i] = emitted[j], m, proposed
                if lps is not None:
                    logprobs[i] = lps[j]
                self._set_state(rid, new_state[j], int(rows.starts[j]) + m)
                self._count(m - 1, proposed)
        else:
            mode.cycles.discard_launched()
        if self.host_drafts:
            self.proposer.observe(step, tokens)
        return StepOutput(tokens, computed, drafted, self._draft_computed(step), logprobs,
                          prompt_lps)

    def _target_rows(self, rows: StepInput, index: list[int], tokens: list[list[int]],
                     logprobs: list | None, prompt_lps: list | None) -> None:
        """Plain target forward over rows that do not speculate; the prefill chunks that may
        speculate and whose proposer is caught up then feed it (pairs f_i, t_{i+1})."""
        runner, proposer = self.runner, self.proposer
        feed = [
            j
            for j in range(rows.bs)
            if proposer.keeps_state
            and rows.speculate[j]
            and self._caught_up(rows.request_ids[j], int(rows.starts[j]))
        ]
        capture = self.capture if feed else None
        batch = runner.prepare(rows)
        if capture is not None:
            capture.enable()
        hidden = runner.forward(batch.input_ids, batch.positions, batch.md)
        feats = None
        if capture is not None:
            feats = capture.pop()  # [T, F]
            capture.disable()
        if prompt_lps is not None:
            for j, entries in enumerate(prompt_logprobs(runner, rows, hidden) or []):
                prompt_lps[index[j]] = entries
        sampled: dict[int, int] = {}
        if batch.sample_index:
            logits = runner.compute_logits(hidden[batch.sample_rows])
            sub = rows.select(batch.sample_index)
            out, lp = sample_logits(runner, sub, logits, runner.sampling_tensors(sub))
            for j, tok in zip(batch.sample_index, out.tolist()):
                sampled[j] = tok
                tokens[index[j]] = [tok]
            if lp is not None:
                for j, entry in zip(batch.sample_index,
                                    logprob_lists(lp, sub.logprobs.tolist())):
                    logprobs[index[j]] = None if entry is None else [entry]
        fed = set(feed)
        self._record(rows, [j for j in range(rows.bs) if j not in fed])
        if not feed:
            return
        nxt = [
            rows.tokens(j)[1:].tolist()
            + [sampled[j] if j in sampled else int(rows.next_token_ids[j])]
            for j in feed
        ]
        if feats is not None and len(feed) < rows.bs:
            at = np.concatenate([np.arange(rows.tok_off[j], rows.tok_off[j + 1]) for j in feed])
            feats = feats.index_select(0, runner.tensor(at))
        sub = rows.select(feed)
        new = proposer.extend(sub.starts.tolist(), sub.page_lists(), nxt, feats)
        for j, rid in enumerate(sub.request_ids):
            self._set_state(rid, new[j], int(sub.seq_lens[j]))

    def _count(self, accepted: int, proposed: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        for d in range(accepted):
            c.accepted_per_pos[d] += 1
