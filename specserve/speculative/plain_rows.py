"""The speculative worker's plain target rows: prefill chunks and decodes that do not
speculate this step, run by the target (or taken from a forward that ran them already),
sampled where they end, and fed to every drafter that keeps state and is caught up."""

from __future__ import annotations

import numpy as np

from specserve.worker.logits import logprob_lists, prompt_logprobs, sample_logits
from specserve.worker.step_input import StepInput
from specserve.worker.token_graphs import forward_step, run_step


def target_rows(worker, rows: StepInput, index: list[int], tokens: list[list[int]],
                logprobs: list | None, prompt_lps: list | None,
                ran: tuple | None = None) -> None:
    """Plain target forward over rows that do not speculate; the prefill chunks that may
    speculate and whose proposers are caught up then feed them (pairs f_i, t_{i+1}).
    ran: (batch, hidden, features or None) of a forward that ran them already (a chain
    cycle's verify forward). worker: the SpecWorker (its runner, drafters' states, feature
    capture and views); tokens, logprobs and prompt_lps: the step's per-row outputs, filled at
    `index`."""
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
    sampled: dict[int, int] = {}
    if sample_index:
        logits = runner.compute_logits(hidden[sample_rows])
        sub = rows.select(sample_index)
        out, lp = sample_logits(runner, sub, logits, runner.sampling_tensors(sub))
        for j, tok in zip(sample_index, out.tolist()):
            sampled[j] = tok
            tokens[index[j]] = [tok]
        if lp is not None:
            for j, entry in zip(sample_index,
                                logprob_lists(lp, sub.logprobs.tolist())):
                logprobs[index[j]] = None if entry is None else [entry]
    for d, feed in feeds.items():
        fed = set(feed)
        d.record(rows, [j for j in range(rows.bs) if j not in fed])
        if not feed:
            continue
        nxt = [
            rows.tokens(j)[1:].tolist()
            + [sampled[j] if j in sampled else int(rows.next_token_ids[j])]
            for j in feed
        ]
        view = worker.views.get(d.method)
        f = view.select(feats) if view is not None and feats is not None else None
        if f is not None and len(feed) < rows.bs:
            at = np.concatenate([np.arange(rows.tok_off[j], rows.tok_off[j + 1])
                                 for j in feed])
            f = f.index_select(0, runner.tensor(at))
        sub = rows.select(feed)
        new = d.proposer.extend(sub.starts.tolist(), sub.page_lists(), nxt, f)
        for j, rid in enumerate(sub.request_ids):
            worker._store(d, rid, new[j], int(sub.seq_lens[j]))
