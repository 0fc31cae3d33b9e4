"""CycleRunner: launches speculative cycles (CUDA graphs when captured) and overlaps them.

One cycle per step for the rows that speculate, then the step's single device-to-host copy:
the emitted tokens. With overlap on, the cycle after this one is launched before this one's
tokens are read: its inputs (the proposer's new state, root position + tokens emitted, the
last emitted token) never leave the device. The next step takes that launch when every row
it speculates has a row there at the same root (same request id; a request that finished
just drops its row); otherwise the launch is forgotten. Its KV writes went to slots past each
request's valid KV that the request still owned (the scheduler keeps W + lookahead slots
ahead), which a fresh cycle rewrites before reading and a later owner of freed pages writes
after, in stream order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specserve.layers.logits_processor import LogitsProcess
from specserve.layers.sampler import SamplingTensors, graph_sampling_inputs
from specserve.speculative.cycle import MODES, NodesForward, SpecCycle
from specserve.worker.cuda_graph import BatchGraphs
from specserve.worker.logits import logits_process, logprob_lists
from specserve.worker.step_input import StepInput


@dataclass
class LaunchedCycle:
    """A cycle launched before the host read the cycle that feeds it."""

    request_ids: list[str]
    starts: list[int]  # each row's root position, known once the feeding cycle is read
    outputs: tuple[torch.Tensor, ...]  # the cycle's outputs (graph buffers on GPUs)


class CycleRunner:
    def __init__(
        self, cycle: SpecCycle, state_dim: int, state_dtype: torch.dtype, synthetic: bool
    ) -> None:
        self.cycle = cycle
        self.runner = cycle.runner
        self.state_dim, self.state_dtype = state_dim, state_dtype
        self.modes = ["synthetic"] if synthetic else ["greedy", "sample"]
        self.graphs = self._capture_graphs()
        self.overlap = self.runner.overlap
        self._launched: LaunchedCycle | None = None
        self.cycles_launched = 0  # cycles launched ahead
        self.cycles_launched_ahead = 0  # of those, taken by the next step

    # -- graphs --------------------------------------------------------------------------------
    def _capture_graphs(self) -> dict[str, BatchGraphs] | None:
        """One graph per batch bucket for each verification mode this config can use."""
        runner = self.runner
        if runner.decode_graphs is None:  # no graphs on this device/backend
            return None
        max_bs = runner.graph_max_bs
        graphs = {}
        for mode in self.modes:
            inputs, pads = self._static_inputs(max_bs)
            graphs[mode] = BatchGraphs(
                self._graph_fn(mode),
                inputs,
                pads,
                max_bs,
                f"speculative {mode}",
                pool=runner.graph_pool,
            )
        return graphs

    def _static_inputs(self, max_bs: int) -> tuple[dict[str, torch.Tensor], dict]:
        runner, dev = self.runner, self.runner.device
        inputs = {
            "state": torch.zeros(max_bs, self.state_dim, dtype=self.state_dtype, device=dev),
            "root_pos": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "root_tokens": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "page_table": torch.zeros(max_bs, runner.max_pages, dtype=torch.int32, device=dev),
            "valid": torch.zeros(max_bs, dtype=torch.bool, device=dev),
        }
        pads = {
            "state": 0.0,
            "root_pos": 0,
            "root_tokens": 0,
            "page_table": runner.spare_page,
            "valid": False,
        }
        st_inputs, st_pads = graph_sampling_inputs(max_bs, runner.model_config.vocab_size, dev)
        inputs.update(st_inputs)
        pads.update(st_pads)
        return inputs, pads

    def _graph_fn(self, mode: str):
        assert mode in MODES

        def fn(
            state,
            root_pos,
            root_tokens,
            page_table,
            valid,
            temperatures,
            top_ks,
            top_ps,
            min_ps,
            seeds,
        ):
            st = SamplingTensors.general(temperatures, top_ks, top_ps, min_ps, seeds, root_pos)
            return self._cycle(mode, state, root_pos, root_tokens, page_table, valid, st)

        return fn

    def _cycle(
        self,
        mode: str,
        state: torch.Tensor,
        root_pos: torch.Tensor,
        root_tokens: torch.Tensor,
        page_table: torch.Tensor,
        valid: torch.Tensor,
        st: SamplingTensors,
        proc: LogitsProcess | None = None,
        logprobs_k: int = -1,
        forward: NodesForward | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The cycle plus the inputs of the cycle after it, on the device: (emitted,
        num_emitted, chain runs, new state, next root position, next root token), then the
        log-prob tensors when logprobs_k >= 0 (eager cycles only, see SpecCycle.run)."""
        emitted, num, chain, new_state, *lp = self.cycle.run(
            mode, state, root_pos, root_tokens, page_table, valid, st, proc, logprobs_k,
            forward
        )
        last = emitted.gather(1, (num - 1).clamp(min=0)[:, None]).squeeze(1)
        return emitted, num, chain, new_state, root_pos + num, last, *lp

    @property
    def num_graphs(self) -> int:
        return sum(len(g.graphs) for g in (self.graphs or {}).values())

    # -- one step ------------------------------------------------------------------------------
    def speculate(
        self, rows: StepInput, state_of: Callable[[], torch.Tensor], launch_next: bool,
        forward: NodesForward | None = None,
    ) -> tuple[list[list[int]], torch.Tensor, list | None, list[int]]:
        """One cycle over the rows (all decodes at their roots). state_of() gives the rows'
        proposer state [bs, S] (not called when the cycle launched ahead holds every row).
        Returns each row's emitted tokens, the new state [bs, S] (a copy: graph outputs
        are reused), when a row asks, per row the emitted tokens' log-prob entries (else
        None), and each row's chain run (SpecCycle.run).
        forward: the verify forward runs inside the caller's (an eager cycle; a cycle
        launched ahead is dropped, none is launched)."""
        starts = rows.starts.tolist()
        launched, self._launched = self._launched, None
        match = None if forward is not None else self.match(launched, rows.request_ids, starts)
        if match is None:
            inputs = {
                "state": state_of(),
                "root_pos": rows.starts.copy(),
                "root_tokens": rows.token_ids.copy(),
            }  # a decode row runs its root only
            out = self.run(rows, inputs, forward)
        else:
            out = launched.outputs
            self.cycles_launched_ahead += 1
            if match != list(range(len(launched.request_ids))):
                idx = torch.tensor(
                    match, dtype=torch.long, pin_memory=self.runner.device.type == "cuda"
                ).to(self.runner.device, non_blocking=True)
                out = tuple(t.index_select(0, idx) for t in out)
        emitted, num_emitted, chain, new_state, next_root, next_token, *lp = out
        new_state = new_state.clone()  # graph outputs are overwritten by the next replay
        host = torch.cat([num_emitted[:, None], chain[:, None], emitted],
                         dim=1).to("cpu", non_blocking=True)
        done = torch.cuda.Event() if self.runner.device.type == "cuda" else None
        if done is not None:
            done.record()
        if launch_next and self.overlap and forward is None:
            self._launch_next(rows, new_state, next_root, next_token)
        if done is not None:
            done.synchronize()  # this cycle's tokens only; the next cycle keeps running
        host = host.tolist()
        tokens = [row[2 : 2 + row[0]] for row in host]
        if self._launched is not None:
            self._launched.starts[:] = [a + len(t) for a, t in zip(starts, tokens)]
        logprobs = None
        if lp:
            w = emitted.shape[1]
            ks = np.repeat(rows.logprobs, w).tolist()
            flat = logprob_lists(tuple(lp), ks)
            logprobs = [None if k < 0 else flat[j * w: j * w + len(t)]
                        for j, (k, t) in enumerate(zip(rows.logprobs.tolist(), tokens))]
        return tokens, new_state, logprobs, [row[1] for row in host]

    def run(self, rows: StepInput, inputs: dict[str, object],
            forward: NodesForward | None = None) -> tuple[torch.Tensor, ...]:
        """Launch one cycle over the rows (inputs: state, root_pos, root_tokens, host or
        device values); returns its device outputs (see _cycle). forward: the caller runs
        the verify forward (eager)."""
        runner = self.runner
        mode = self._mode(rows)
        table, width = runner.page_table(rows)
        inputs.update(page_table=table, valid=np.ones(rows.bs, dtype=bool))
        if forward is None and self.graphed(rows):
            inputs.update(runner.sampling_fields(rows))
            return self.graphs[mode].replay(rows.bs, widths={"page_table": width}, **inputs)
        # counters are unused: verification keys its noise by root position
        st = runner.sampling_tensors(rows, counters=np.zeros(rows.bs, dtype=np.int64))
        dev = {k: torch.as_tensor(v).to(runner.device) for k, v in inputs.items()}
        return self._cycle(
            mode,
            dev["state"],
            dev["root_pos"],
            dev["root_tokens"],
            dev["page_table"],
            dev["valid"],
            st,
            logits_process(runner, rows, runner.model_config.vocab_size),
            int(rows.logprobs.max()),
            forward,
        )

    def _mode(self, rows: StepInput) -> str:
        """The verification mode of a cycle over these rows."""
        if len(self.modes) == 1:
            return self.modes[0]
        return "greedy" if rows.greedy.all() else "sample"

    def graphed(self, rows: StepInput) -> bool:
        """A cycle over these rows (its verify forward its own) replays a captured graph."""
        graphs = self.graphs.get(self._mode(rows)) if self.graphs else None
        return graphs is not None and rows.bs <= graphs.max_bs and not rows.eager

    def holds(self, rows: StepInput) -> bool:
        """The cycle launched ahead holds every one of these rows at its root."""
        return self.match(self._launched, rows.request_ids, rows.starts.tolist()) is not None

    @staticmethod
    def match(
        launched: LaunchedCycle | None, request_ids: list[str], starts: list[int]
    ) -> list[int] | None:
        """Rows of the launched cycle for these requests (same id, same root), or None unless
        it holds every one of them."""
        if launched is None:
            return None
        row_of = {rid: j for j, rid in enumerate(launched.request_ids)}
        rows = [row_of.get(rid) for rid in request_ids]
        if any(j is None or launched.starts[j] != p for j, p in zip(rows, starts)):
            return None
        return rows

    def _launch_next(
        self,
        rows: StepInput,
        new_state: torch.Tensor,
        next_root: torch.Tensor,
        next_token: torch.Tensor,
    ) -> None:
        """Launch the next cycle of these requests from this one's device outputs, if every
        request owns the slots it may need (root up to W past this one, plus lookahead)."""
        runner, w = self.runner, self.cycle.shape.width
        need = rows.starts + w + self.cycle.lookahead + 1
        if (rows.page_counts * runner.page_size < need).any() or (
            need > runner.max_positions
        ).any():
            return
        if (rows.tokens_left <= 1).all():
            return  # this cycle ends every one of them
        if rows.eager:
            return  # logits processing reads tokens the host has not seen yet
        out = self.run(
            rows, {"state": new_state, "root_pos": next_root, "root_tokens": next_token}
        )
        self._launched = LaunchedCycle(list(rows.request_ids), [-1] * rows.bs, out)
        self.cycles_launched += 1

    def holds_requests(self, request_ids: list[str]) -> bool:
        """The cycle launched ahead covers every one of these requests (by id: its roots are
        set once the step that launched it is read)."""
        launched = self._launched
        return launched is not None and set(request_ids) <= set(launched.request_ids)

    def discard_launched(self) -> None:
        self._launched = None
