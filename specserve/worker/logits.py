"""What a runner does with a batch's logits beyond the sampler: logits processing
(layers/logits_processor.py) and log-probs of the emitted and of the prompt tokens, as host
lists of [log-prob, [top ids], [top log-probs]] entries. `runner` is the ModelRunner."""

from __future__ import annotations

import numpy as np
import torch

from specserve.layers.logits_processor import LogitsProcess, RowHistory, token_logprobs
from specserve.layers.sampler import SamplingTensors
from specserve.worker.step_input import StepInput


def logits_process(runner, rows: StepInput, vocab: int) -> LogitsProcess | None:
    """The rows' logits-processing state on the device; None when no row uses it."""
    active = np.flatnonzero(rows.processed)
    if not len(active):
        return None
    index = None
    if len(active) < rows.bs:  # tables for the processed rows only
        rows, index = rows.select(active), torch.from_numpy(active).to(runner.device)
    h = RowHistory(rows.presence_penalty, rows.frequency_penalty, rows.repetition_penalty,
                   rows.min_left, rows.history_ids, rows.history_counts,
                   rows.history_outputs, rows.bias_ids, rows.bias_values,
                   rows.bias_counts, rows.suppress_ids, rows.suppress_counts)
    return LogitsProcess.build(h, vocab, runner.device, index)


def sample_logits(runner, rows: StepInput, logits: torch.Tensor, st: SamplingTensors
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Tokens [bs] from the rows' logits [bs, V] (processed when a row asks), and the
    raw log-probs (chosen [bs], top values [bs, k], top ids [bs, k]) when a row wants
    them (k: the most any row asks)."""
    proc = logits_process(runner, rows, logits.shape[-1])
    tokens = runner.sampler.sample(logits if proc is None else proc.apply(logits), st)
    k = int(rows.logprobs.max()) if rows.bs else -1
    if k < 0:
        return tokens, None
    return tokens, token_logprobs(logits, tokens, k)


def prompt_logprobs(runner, rows: StepInput, hidden: torch.Tensor) -> list | None:
    """Per row asking (prompt_logprobs >= 0), the raw log-prob entries of the prompt
    tokens after its chunk's positions (those below num_prompt - 1); hidden [T, H]: the
    rows' hidden states, rows concatenated. None when no row asks."""
    ask = np.flatnonzero(rows.prompt_logprobs >= 0).tolist()
    if not ask:
        return None
    at, targets, counts = [], [], []
    for r in ask:
        start, n = int(rows.starts[r]), int(rows.num_new_tokens[r])
        m = max(0, min(n, int(rows.num_prompt[r]) - 1 - start))  # positions with a next
        after = rows.tokens(r)[1:].tolist() + [int(rows.next_token_ids[r])]
        at += range(int(rows.tok_off[r]), int(rows.tok_off[r]) + m)
        targets += after[:m]
        counts.append(m)
    k = int(rows.prompt_logprobs.max())
    logits = runner.compute_logits(hidden[runner.tensor(at)])
    flat = logprob_lists(token_logprobs(logits, runner.tensor(targets), k), [k] * len(at))
    out: list = [None] * rows.bs
    pos = 0
    for r, m in zip(ask, counts):
        out[r] = [[lp, ids[: rows.prompt_logprobs[r]], vals[: rows.prompt_logprobs[r]]]
                  for lp, ids, vals in flat[pos : pos + m]]
        pos += m
    return out


def logprob_lists(lp: tuple[torch.Tensor, ...], ks: list[int]) -> list[list | None]:
    """Host lists of sample_logits' log-probs, one [log-prob, [top ids], [top log-probs]]
    per row (leading dims flattened to rows); None for rows that did not ask (k < 0)."""
    chosen, top_v, top_i = (t.reshape(-1, *t.shape[len(lp[0].shape):]).tolist() for t in lp)
    return [None if k < 0 else [c, i[:k], v[:k]]
            for c, v, i, k in zip(chosen, top_v, top_i, ks)]
