"""The speculative worker's plain target rows: prefill chunks and decodes that do not
speculate this step, run by the target (or taken from a forward that ran them already),
sampled where they end, and fed to every drafter that keeps state and is caught up."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specserve.worker.logits import logprob_lists, prompt_logprobs, sample_logits
from specserve.worker.step_input import StepInput
from specserve.worker.token_graphs import forward_step, run_step


def target_rows(worker, rows: StepInput, index: list[int], tokens: list[list[int]],
                logprobs: list | None, prompt_lps: list | None,
                ran: tuple | None = None) -> Callable[[], None]:
    """Plain target forward over rows that do not speculate; the prefill chunks that may
    speculate and whose proposers are caught up then feed them (pairs f_i, t_{i+1}).
    ran: (batch, hidden, features or None) of a forward that ran them already (a chain
    cycle's verify forward). worker: the SpecWorker (its runner, drafters' states, feature
    capture and views); tokens, logprobs and prompt_lps: the step's per-row outputs, filled at
    `index` by the returned `finish`. Everything here is launched without reading the device:
    a chunk's sampled token reaches the drafter's extend as a device value, so the caller
    launches the step's cycle before `finish` waits for the sampled tokens (a host sync in
    between left the GPU idle while the host built the extend and the cycle)."""
    runner = worker.runner
    starts, ids = rows.starts.tolist(), rows.request_ids
    feeds = {
        d: [j for j in range(rows.bs)
            if rows.speculate[j] and d.caught_up(ids[j], starts[j])]
        for d in worker.stateful
    }
    feats = None
    if ran is not None:
        batch, hidden, feats = ran
        sample_rows, sample_index = batch.sample_rows, batch.sample_index
        if feats is None:  # nothing captured: features are fed to no one
            feeds = {d: [] if d.method in worker.views else f for d, f in feeds.items()}
    elif not any(feed and d.method in worker.views for d, feed in feeds.items()):
        hidden, sample_rows, sample_index = forward_step(runner, rows)  # no features needed
    elif (graphed := run_step(runner, rows, "features")) is not None:
        (hidden, feats), sample_rows, sample_index = graphed
    else:
        batch = runner.prepare(rows)
        sample_rows, sample_index = batch.sample_rows, batch.sample_index
        hidden, feats = worker._features_forward(batch.input_ids, batch.positions, batch.md)
    if prompt_lps is not None:
        for j, entries in enumerate(prompt_logprobs(runner, rows, hidden) or []):
            prompt_lps[index[j]] = entries
    out = lp = None
    lp_ks: list[int] = []  # each sampled row's log-probs asked (-1: none)
    if sample_index:
        logits = runner.compute_logits(hidden[sample_rows])
        sub = rows.select(sample_index)
        out, lp = sample_logits(runner, sub, logits, runner.sampling_tensors(sub))
        lp_ks = sub.logprobs.tolist()
    for d, feed in feeds.items():
        fed = set(feed)
        d.record(rows, [j for j in range(rows.bs) if j not in fed])
        if not feed:
            continue
        # t_{i+1} of each fed row's positions: its chunk's next tokens, the last one the
        # token sampled here (on the device) where the chunk ends its prompt
        nxt = [rows.tokens(j)[1:].tolist() + [int(rows.next_token_ids[j])] for j in feed]
        last = _sampled_last(runner, feed, sample_index, out, nxt)
        view = worker.views.get(d.method)
        f = view.select(feats) if view is not None and feats is not None else None
        if f is not None and len(feed) < rows.bs:
            at = np.concatenate([np.arange(rows.tok_off[j], rows.tok_off[j + 1])
                                 for j in feed])
            f = f.index_select(0, runner.tensor(at))
        sub = rows.select(feed)
        new = d.proposer.extend(sub.starts.tolist(), sub.page_lists(), nxt, f, last=last)
        for j, rid in enumerate(sub.request_ids):
            worker._store(d, rid, new[j], int(sub.seq_lens[j]))

    def finish() -> None:
        if out is None:
            return
        for j, tok in zip(sample_index, out.tolist()):
            tokens[index[j]] = [tok]
        if lp is not None:
            for j, entry in zip(sample_index, logprob_lists(lp, lp_ks)):
                logprobs[index[j]] = None if entry is None else [entry]

    return finish


def _sampled_last(runner, feed: list[int], sample_index: list[int], out: torch.Tensor | None,
                  nxt: list[list[int]]) -> torch.Tensor | None:
    """[len(feed)] device tokens that end each fed row's next tokens: the sampled token of
    the rows that sampled (their host placeholder in `nxt` is replaced), the host's last next
    token of the others; None when no fed row sampled (the host lists hold them all)."""
    at = {j: k for k, j in enumerate(sample_index)}
    pairs = [(r, at[j]) for r, j in enumerate(feed) if j in at]
    if not pairs or out is None:
        return None
    last = runner.tensor([row[-1] for row in nxt])
    dst, src = (runner.tensor(list(x)) for x in zip(*pairs))
    return last.index_copy(0, dst, out.index_select(0, src).to(last.dtype))
