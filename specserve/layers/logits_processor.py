"""Logits processing that reads a request's own history: logit_bias, min_tokens, penalties.

Applied to the target's raw logits before the sampling transform (layers/sampler.py), in
vLLM's order:

    logits[t] += logit_bias[t]
    logits[t]  = -inf            for t in EOS + stop_token_ids while outputs < min_tokens
    logits[t]  = logits[t] / r   if logits[t] > 0 else logits[t] * r
                                 for t in prompt + outputs      (repetition_penalty r, HF)
    logits[t] -= f * count[t] + p * (count[t] > 0)
                                 count: t's occurrences in the outputs (OpenAI frequency f,
                                 presence p)

Greedy rows take the argmax of the processed logits, sampled rows sample from them.

Speculation stays lossless: a verify node at depth d decides the output token d places past
the root's, as if the draft tokens on its path (depths 1..d) were already generated, so its
counts include them and min_tokens compares against outputs + d (`for_tree`). The state is
rebuilt on every step from the StepInput (the row's tokens travel with it), so preemption,
recompute and prefix caching need nothing, and every TP rank sees the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowHistory:
    """Host arrays of the rows of one batch (one entry per row), as the StepInput carries
    them. Flat arrays are the rows' values concatenated, with per-row counts."""

    presence: np.ndarray  # [bs] float32
    frequency: np.ndarray  # [bs] float32
    repetition: np.ndarray  # [bs] float32, 1 = off
    min_left: np.ndarray  # [bs] int64: outputs still to come before suppress ids may be
    history_ids: np.ndarray  # flat: the row's prompt (repetition only) + output tokens
    history_counts: np.ndarray  # [bs]
    history_outputs: np.ndarray  # [bs] how many of the row's history ids are outputs (last)
    bias_ids: np.ndarray  # flat
    bias_values: np.ndarray  # flat float32
    bias_counts: np.ndarray  # [bs]
    suppress_ids: np.ndarray  # flat: EOS + stop_token_ids of rows under min_tokens
    suppress_counts: np.ndarray  # [bs]


@dataclass
class LogitsProcess:
    """Per-row device state: dense [rows, V] tables of the batch rows `index` (None: every
    row), built only for batches that use them; other rows pass through unchanged."""

    counts: torch.Tensor  # [rows, V] float32 occurrences in the outputs
    seen: torch.Tensor  # [rows, V] bool: in the prompt or outputs (repetition penalty)
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32
    min_left: torch.Tensor  # [rows] int64
    suppress: torch.Tensor  # [rows, V] bool
    bias: torch.Tensor  # [rows, V] float32
    index: torch.Tensor | None = None  # [rows] int64 batch rows of the tables; None: all

    @classmethod
    def build(cls, h: RowHistory, vocab: int, device: torch.device | str,
              index: torch.Tensor | None = None) -> LogitsProcess:
        bs = len(h.presence)

        def rows_of(counts: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.repeat(np.arange(bs), counts)).to(device)

        def ids(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

        f32 = torch.float32
        hist_rows, hist = rows_of(h.history_counts), ids(h.history_ids)
        # a history entry is an output iff it is among the row's last history_outputs ones
        ends = np.cumsum(h.history_counts)
        within_from_end = np.repeat(ends, h.history_counts) - np.arange(len(h.history_ids))
        is_out = torch.from_numpy(within_from_end <= np.repeat(h.history_outputs,
                                                               h.history_counts)).to(device)
        counts = torch.zeros(bs, vocab, dtype=f32, device=device)
        counts.index_put_((hist_rows, hist), is_out.to(f32), accumulate=True)
        seen = torch.zeros(bs, vocab, dtype=torch.bool, device=device)
        seen[hist_rows, hist] = True
        suppress = torch.zeros(bs, vocab, dtype=torch.bool, device=device)
        keep = h.suppress_ids < vocab  # an EOS id past a padded head's vocab cannot appear
        suppress[rows_of(h.suppress_counts)[torch.from_numpy(keep).to(device)],
                 ids(h.suppress_ids[keep])] = True
        bias = torch.zeros(bs, vocab, dtype=f32, device=device)
        bias.index_put_((rows_of(h.bias_counts), ids(h.bias_ids)),
                        torch.from_numpy(np.asarray(h.bias_values, dtype=np.float32)).to(device),
                        accumulate=True)

        def vec(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)

        return cls(counts, seen, vec(h.presence, f32), vec(h.frequency, f32),
                   vec(h.repetition, f32), vec(h.min_left, torch.int64), suppress, bias, index)

    def for_tree(self, tokens: torch.Tensor, mask: torch.Tensor,
                 depth: torch.Tensor) -> LogitsProcess:
        """One row per tree node ([bs * n] rows, node-major within a request): node i's
        history adds the draft tokens of its path at depths >= 1 (tokens [bs, n]; mask
        [bs, n, n], mask[b, i, j]: j is i or an ancestor of i; depth [bs, n]), and its
        min_tokens budget is consumed by its depth."""
        n = tokens.shape[1]
        node_index = None
        if self.index is not None:  # the tree rows of the processed requests only
            tokens, mask, depth = tokens[self.index], mask[self.index], depth[self.index]
            node_index = (self.index[:, None] * n + torch.arange(n, device=tokens.device)
                          ).reshape(-1)
        bs, vocab = tokens.shape[0], self.counts.shape[-1]
        on_path = (mask & (depth >= 1)[:, None, :]).to(torch.float32)  # [bs, n(i), n(j)]
        extra = torch.zeros(bs, n, vocab, dtype=torch.float32, device=tokens.device)
        extra.scatter_add_(2, tokens[:, None, :].expand(bs, n, n).long(), on_path)
        counts = self.counts[:, None, :] + extra  # [bs, n, V]
        seen = self.seen[:, None, :] | (extra > 0)

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(n, dim=0)

        return LogitsProcess(
            counts.view(bs * n, vocab), seen.view(bs * n, vocab), rep(self.presence),
            rep(self.frequency), rep(self.repetition),
            (self.min_left[:, None] - depth.long()).reshape(-1), rep(self.suppress),
            rep(self.bias), node_index)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[bs, V] raw logits -> [bs, V] float32 processed logits (a new tensor)."""
        if self.index is None:
            return self._transform(logits)
        out = logits.float().clone()
        out[self.index] = self._transform(logits[self.index])
        return out

    def _transform(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() + self.bias
        x = x.masked_fill(self.suppress & (self.min_left > 0)[:, None], -torch.inf)
        r = self.repetition[:, None]
        x = torch.where(self.seen, torch.where(x > 0, x / r, x * r), x)
        x = x - self.frequency[:, None] * self.counts
        return x - self.presence[:, None] * (self.counts > 0).to(torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probs (log_softmax of the unprocessed logits, in float32): logits [..., V],
    tokens [...] -> (the tokens' log-probs [...], top-k values [..., k], top-k ids [..., k])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.long().clamp(min=0)[..., None]).squeeze(-1)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[..., :0], lp[..., :0].long())
    return chosen, top_v, top_i
