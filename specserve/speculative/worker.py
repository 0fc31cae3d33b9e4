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
    up over them: a target forward writing no KV (it is there) gives the features, then
    `Proposer.extend` (both through token graphs where captured): one prefill of them.
Prefix caching: a row marked `from_cache` starts at the end of a cached prefix whose draft KV
is in the pages already (cached with the target's, under keys that cover it): the proposer
covers [0, start) at once and the row's chunk feeds it (or is caught up) like any other; its
state row comes from that chunk, which always runs at least one token. Every step reports how
far each row's draft KV is valid (`StepOutput.draft_computed`): the scheduler caches no page
past it.
Several drafters: the worker may hold a primary proposer plus extra model-free ones (modes
'ngram:chain4', spec_config.check_mode), one DraftState each. A cycle of proposer A is, for
every other proposer B that keeps state, like a plain step: B records the tokens whose target
KV became valid (root and accepted drafts, positions P .. P + m - 1) and catches up before it
next speculates. The pages' draft KV is valid up to the minimum over the proposers.
A speculative step's only device-to-host copy: the emitted tokens with each row's chain run
(and prefill chunks' sampled tokens).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specserve.config import SpecConfig
from specserve.layers.attention_metadata import AttentionMetadata
from specserve.models.capture import AuxHiddenCapture
from specserve.spec_config import full_mode_name
from specserve.speculative.catch_up import catch_up
from specserve.speculative.cycle import SpecCycle
from specserve.speculative.cycle_runner import CycleRunner
from specserve.speculative.draft_state import DraftState
from specserve.speculative.extend_graphs import covers, graph_extends
from specserve.speculative.features import FeatureView
from specserve.speculative.mixed import ChunksInVerify, takes_trees
from specserve.speculative.plain_rows import target_rows
from specserve.speculative.proposer import DraftShape, Proposer, draft_shapes
from specserve.worker.eager_warm import warm_drafters, warms
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
    num_chunks_in_verify: int = 0  # steps whose prefill chunks ran in the verify forward
    # steps per mode ("off": plain; "fold": decodes folded into prefill chunks' forward)
    mode_steps: dict[str, int] = field(default_factory=dict)
    method_drafts: dict[str, int] = field(default_factory=dict)  # cycles per drafter
    method_accepted_tokens: dict[str, int] = field(default_factory=dict)  # accepted, per drafter
    method_catch_ups: dict[str, int] = field(default_factory=dict)  # catch-ups, per drafter


@dataclass
class DraftMode:
    """One draft shape of one drafter with its cycle, its graphs and the slots it needs past
    the root."""

    shape: DraftShape
    lookahead: int  # slots past the root a decode must own: verify nodes and draft scratch
    cycle: SpecCycle
    cycles: CycleRunner
    method: str = ""  # the drafter's method (spec.algorithm for the primary)
    draft: DraftState | None = None  # its per-request state


class SpecWorker:
    def __init__(self, spec: SpecConfig, runner, proposer: Proposer,
                 extra: dict[str, Proposer] | None = None) -> None:
        """proposer: the primary drafter (spec.algorithm); extra: method -> a drafter of the
        modes spec.modes prefixes with it (needing no target features)."""
        self.spec, self.runner = spec, runner  # runner: ModelRunner
        self.proposer = proposer
        self.method = spec.algorithm
        self.proposers: dict[str, Proposer] = {self.method: proposer, **(extra or {})}
        self.drafts = {m: DraftState(m, p, runner.device) for m, p in self.proposers.items()}
        self.primary = self.drafts[self.method]
        self.stateful = [d for d in self.drafts.values() if d.keeps_state]
        # tokens per catch-up forward: the scheduler's budget (what activations were sized for)
        self.catch_up_tokens = runner.config.scheduler.max_num_batched_tokens
        # a step's prefill chunks ride in its cycle's verify forward (a tree's: MHA/GQA
        # only): "always", "never", or "auto" (see chunks_ride_along)
        self.chunks_in_verify = "auto"
        self.trees_split = takes_trees(runner)
        # one capture over every drafter's aux layers; each reads its own through a view
        readers = {m: p for m, p in self.proposers.items() if p.needs_target_features}
        self.capture = None
        self.views: dict[str, FeatureView] = {}
        if readers:
            ids = sorted({i for p in readers.values() for i in p.aux_layer_ids})
            if len(readers) == 1:  # as the drafter lists them (a repeated id is repeated)
                ids = list(next(iter(readers.values())).aux_layer_ids)
            self.capture = AuxHiddenCapture(runner.model, ids)
            self.capture.disable()
            hidden = runner.model_config.hidden_size
            self.views = {m: FeatureView(self.capture, p.aux_layer_ids, hidden, runner.device)
                          for m, p in readers.items()}
            if getattr(runner, "token_graphs", None) is not None:  # chunks that feed them
                runner.token_graphs.add_variant("features", self._features_forward)
                graph_extends(runner, [d.proposer for d in self.stateful], self.catch_up_tokens)
        self.modes: dict[str, DraftMode] = {}
        t0, mem0 = time.perf_counter(), _device_memory(runner.device)
        for method, p in self.proposers.items():
            capture = self.views.get(method)
            for shape in draft_shapes(spec.for_method(method)):
                lookahead = max(shape.num_draft_tokens, p.scratch_slots(shape)) - 1
                cycle = SpecCycle(runner, p, shape, lookahead, capture,
                                  spec.synthetic_accept_len, spec.synthetic_accept_rate)
                cycles = CycleRunner(cycle, p.state_dim, p.state_dtype, spec.synthetic)
                name = full_mode_name(method, shape.name, self.method)
                self.modes[name] = DraftMode(shape, lookahead, cycle, cycles, method,
                                             self.drafts[method])
        if self.num_graphs:
            log.info("speculative graphs: %d for modes %s in %.1f s, %.0f MiB of device memory",
                     self.num_graphs, ", ".join(self.modes), time.perf_counter() - t0,
                     (_device_memory(runner.device) - mem0) / 2**20)
        if warms(runner):  # eager extends (past any graphs) compile now, not inside a step
            warm_drafters(runner, {d.method: d.proposer for d in self.stateful
                                   if not covers(d.proposer, self.catch_up_tokens)})
        default = next(iter(self.modes.values()))  # the configured shape
        self.default_mode = default.shape.name
        self.shape, self.cycle, self.cycles = default.shape, default.cycle, default.cycles
        self.k, self.num_steps, self.n = (self.shape.topk, self.shape.num_steps,
                                          self.shape.num_draft_tokens)
        # admission and page reservations: the most any mode needs
        self.lookahead = max(m.lookahead for m in self.modes.values())
        max_steps = max(m.shape.num_steps for m in self.modes.values())
        self.counters = SpecCounters(accepted_per_pos=[0] * max_steps,
                                     mode_steps=dict.fromkeys(["off", "fold", *self.modes], 0),
                                     method_drafts=dict.fromkeys(self.proposers, 0),
                                     method_accepted_tokens=dict.fromkeys(self.proposers, 0))
        # a proposer whose trees the host builds from the previous cycle's tokens
        # (`host_drafts`, e.g. suffix decoding) cannot launch a cycle ahead: overlap off
        self.host_drafts = any(d.host_drafts for d in self.drafts.values())
        self.overlap = runner.overlap and not self.host_drafts
        if self.host_drafts:
            for m in self.modes.values():
                m.cycles.overlap = False
        # overlap: the next cycle is launched before this one is read; its requests keep the
        # slots it may write, up to W + lookahead past their valid KV
        self.keep_ahead = max(m.shape.width + m.lookahead for m in self.modes.values()) \
            if self.overlap else 0

    # -- the primary drafter's per-request state (tests, older callers) --------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.primary.state

    @property
    def covered(self) -> dict[str, int]:
        return self.primary.covered

    def has_request_state(self) -> bool:
        """Any drafter holds state of some request."""
        return any(d.request_ids() or d.state or d.pending for d in self.drafts.values())

    def release(self, request_id: str) -> None:
        for d in self.drafts.values():
            d.release(request_id)

    def release_all(self) -> None:
        for d in self.drafts.values():
            for rid in sorted(d.request_ids()):
                d.release(rid)

    def _set_state(self, rid: str, row: torch.Tensor, covered: int) -> None:
        self.primary.set_state(rid, row, covered)

    def _store(self, d: DraftState, rid: str, row: torch.Tensor, covered: int) -> None:
        if d is self.primary:
            self._set_state(rid, row, covered)  # (a hook tests wrap)
        else:
            d.set_state(rid, row, covered)

    def _draft_computed(self, step: StepInput) -> list[int] | None:
        """Per row: positions whose draft KV is valid now in every drafter keeping state
        (None: no draft KV in the pages)."""
        if not self.stateful:  # (one list per drafter, then a min per row: ~3x a generator's)
            return None
        ids = step.request_ids
        return [min(v) for v in zip(*([d.covered.get(r, 0) for r in ids] for d in self.stateful))]

    def _observe(self, step: StepInput, tokens: list[list[int]]) -> None:
        for d in self.drafts.values():
            if d.host_drafts:
                d.proposer.observe(step, tokens)

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
        for d in self.drafts.values():
            d.state.clear()
        self.cycles = self.cycle = self.proposer = None  # type: ignore[assignment]
        self.proposers, self.drafts, self.views, self.stateful = {}, {}, {}, []
        self.primary = None  # type: ignore[assignment]
        for mode in self.modes.values():
            mode.draft = None

    def chunks_ride_along(self, mode: DraftMode, rows: StepInput, chunks: StepInput) -> bool:
        """Whether the step's prefill chunks run inside its cycle's verify forward (one pass
        over the weights, but the rest of that cycle, draft loop and acceptance, eager) or in
        a forward of their own before the cycle. "auto": their own where both replay CUDA
        graphs (the chunks a token graph, the cycle its captured graph): on an H100 a chain
        cycle carrying chunks cost 2-4x a decode cycle, where the graphed chunk forward and
        cycle cost about their kernel times (experiments/2026-12-06-h100-token-graphs-exact-
        spec.md); along otherwise (eager either way, and one forward fewer)."""
        if self.chunks_in_verify != "auto":
            return self.chunks_in_verify == "always"
        graphs = getattr(self.runner, "token_graphs", None)
        own = graphs is not None and graphs.bucket(len(chunks.token_ids), chunks.bs) is not None
        return not (own and mode.cycles.graphed(rows))

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
            and mode.draft.reachable(step.request_ids[i], start)
        )

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_ids + step.preempted_ids:
            self.release(rid)  # preempted: their KV is gone; re-prefill rebuilds the state
        for d in self.stateful:
            d.restore_cached(step)
        mode = None
        if step.speculate.any():
            mode = self.modes.get(step.spec_mode)
            if mode is None:
                raise ValueError(f"draft mode {step.spec_mode!r} is not one of {list(self.modes)}")
        self.discard_launched(keep=mode)  # a launch ahead is only taken by its own mode
        if step.bs:
            self.counters.mode_steps["off" if mode is None else "fold" if step.fold
                                     else step.spec_mode] += 1
        if mode is None:  # off: the plain step, no draft forward
            for d in self.stateful:
                d.record(step, range(step.bs))
            out = self.runner.execute(step)
            out.draft_computed = self._draft_computed(step)
            self._observe(step, out.token_ids)
            return out
        self.runner.discard_launched()
        tokens: list[list[int]] = [[] for _ in range(step.bs)]
        computed = step.num_new_tokens.tolist()
        drafted, runs = [0] * step.bs, [-1] * step.bs  # runs: chain runs of a tree's rows
        logprobs: list | None = [None] * step.bs if (step.logprobs >= 0).any() else None
        prompt_lps: list | None = [None] * step.bs if (step.prompt_logprobs >= 0).any() \
            else None
        # folded: every row in one target forward, the caught-up ones feeding the drafter
        decodes = [] if step.fold else [i for i in range(step.bs)
                                        if self._can_speculate(step, i, mode)]
        spec = set(decodes)
        others = [i for i in range(step.bs) if i not in spec]
        rows = step.select(decodes) if decodes else None
        # the cycle's verify forward takes the prefill chunks along (speculative/mixed.py),
        # unless this step's cycle was launched ahead already (its verify is on the device)
        chunks = finish = None  # finish: the plain rows' outputs, read after the cycle's launch
        # a chain's nodes and the chunks in one causal attention (in exact mode too: a causal
        # extend's rows equal decodes of their tokens); a tree's under SplitMetadata
        causal = mode.shape.topk == 1
        if others and rows is not None and (causal or self.trees_split) \
                and not mode.cycles.holds(rows) \
                and self.chunks_ride_along(mode, rows, step.select(others)):
            chunks = ChunksInVerify(self.runner, step.select(others), rows, self.capture,
                                    self.views.get(mode.method), causal)
            self.counters.num_chunks_in_verify += 1
        elif others:
            finish = target_rows(self, step.select(others), others, tokens, logprobs, prompt_lps)
        if rows is not None:
            self._catch_up(mode.draft, rows)
            draft = mode.draft
            # no launch ahead while prefill chunks run: a request finishing its prefill here
            # speculates next step (the launch would not hold it), and a chunk that goes on
            # runs next step in the verify forward of a cycle launched then
            emitted, new_state, lps, chain = mode.cycles.speculate(
                rows, lambda: draft.states(rows, mode.shape), launch_next=not others,
                forward=chunks
            )
            if chunks is not None:
                target_rows(self, chunks.chunks, others, tokens, logprobs, prompt_lps,
                            ran=(chunks.batch, chunks.hidden, chunks.feats))()
            proposed = mode.shape.num_draft_tokens - 1
            roots = rows.token_ids.tolist()  # one token per decode row
            for j, (i, rid) in enumerate(zip(decodes, rows.request_ids)):
                m = len(emitted[j])
                tokens[i], computed[i], drafted[i], runs[i] = emitted[j], m, proposed, chain[j]
                if lps is not None:
                    logprobs[i] = lps[j]
                start = int(rows.starts[j])
                self._store(draft, rid, new_state[j], start + m)
                for other in self.stateful:  # KV valid at P .. P+m-1: root, accepted drafts
                    if other is not draft:
                        other.append(rid, start, [roots[j], *emitted[j][:m - 1]])
                self._count(mode.method, m - 1, proposed)
        else:
            mode.cycles.discard_launched()
        if finish is not None:
            finish()
        self._observe(step, tokens)
        return StepOutput(tokens, computed, drafted, self._draft_computed(step), logprobs,
                          prompt_lps, runs if mode.shape.topk > 1 and rows is not None else None)

    def _features_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                          md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward and every drafter's aux features [T, F] (a token graph)."""
        self.capture.enable()
        hidden = self.runner.forward(ids, positions, md)
        feats = self.capture.pop()
        self.capture.disable()
        return hidden, feats

    def _catch_up(self, d: DraftState, rows: StepInput) -> None:
        """Bring drafter d of rows whose state went stale (plain steps, other drafters'
        cycles) up to their root (speculative/catch_up.py)."""
        c = self.counters
        for rid, row, covered, missed, done in catch_up(self, d, rows, self.catch_up_tokens):
            self._store(d, rid, row, covered)
            c.num_catch_up_tokens += missed
            if done:
                c.num_catch_ups += 1
                c.method_catch_ups[d.method] = c.method_catch_ups.get(d.method, 0) + 1

    def _count(self, method: str, accepted: int, proposed: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        c.method_drafts[method] = c.method_drafts.get(method, 0) + 1
        c.method_accepted_tokens[method] = c.method_accepted_tokens.get(method, 0) + accepted
        for d in range(accepted):
            c.accepted_per_pos[d] += 1
