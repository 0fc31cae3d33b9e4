"""Prompt-lookup n-gram drafting (method "ngram"), on the device, with no draft model.

Rule (vLLM's prompt lookup): for n from prompt_lookup_max down to prompt_lookup_min, find the
most recent earlier occurrence of the context's last n tokens in the request's prompt +
output; the first n with one wins and the draft chain is the k tokens that followed it
(fewer when the sequence ends first; the rest of the chain is filler the target rejects or,
if right, accepts: verification is lossless whatever is drafted).

Token history. The proposer keeps one int64 per KV slot of the pool (`TokenHistory`): the slot
of position i holds t_{i+1}, the token after it, i.e. the same (f_i, t_{i+1}) pairing the
worker feeds every proposer, so the history lives in the request's pages: prefill chunks and
catch-ups write it in `extend`, cycles in `extend_accepted` (a device scatter), and a prefix
cache hit brings it along with the target's KV (prefix_cache_key; pages are keyed by the next
token too). A request's history is read through its page table, positions [0, P) for a root
at P: the sequence t_1 .. t_P (the prompt's first token is not in it).

Cost per cycle, static shapes (graph-capturable), no host work. On CUDA a Triton kernel reads
each row's history through its page table up to the row's own length and no further
(kernels/ngram_lookup.py), so the cost follows the requests' lengths, not the context limit;
elsewhere one gather of page_table width * page_size slots per row and prompt_lookup_max
compare-and passes over it (ngram_match), O(context limit).
"""

from __future__ import annotations

import torch

from specserve.kernels.dispatch import host_launches, use_triton
from specserve.kernels.ngram_lookup import ngram_ends
from specserve.speculative.cycle import kv_slots
from specserve.speculative.proposer import DraftShape
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import VerifyResult


def ngram_match(seq: torch.Tensor, length: torch.Tensor, k: int, lo: int,
                hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq [bs, L] token ids (entries at or past length ignored), length [bs] <= L. For each
    row: the k tokens after the most recent earlier occurrence of its last n tokens, for the
    largest n in [lo, hi] with one. Returns drafts [bs, k] (-1 past the sequence's end or
    without a match) and num_found [bs] (the drafts that are real tokens)."""
    best_end = ngram_best_end(seq, length, lo, hi)
    take, real = follow(best_end, length, k)
    drafts = torch.where(real, seq.gather(1, take.clamp(max=seq.shape[1] - 1)), -1)
    return drafts, real.sum(dim=1)


def follow(best_end: torch.Tensor, length: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k positions after each row's end [bs, k], and which are real (a match, before the
    sequence's end)."""
    take = best_end[:, None] + 1 + torch.arange(k, device=best_end.device)
    return take, (best_end[:, None] >= 0) & (take < length[:, None])


def ngram_best_end(seq: torch.Tensor, length: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """[bs] end index of ngram_match's occurrence, -1 without one.

    An occurrence ending at index e (e < length - 1: at least one token follows) matches n
    tokens iff seq[e - i] == seq[length - 1 - i] for i < n; matching n + 1 adds one compare to
    matching n, so prompt_lookup_max passes over [bs, L] cover every n."""
    bs, L = seq.shape
    dev = seq.device
    idx = torch.arange(L, device=dev)
    seq = torch.where(idx < length[:, None], seq, -1)
    # left-padded copy: shifted[:, e] = seq[e - i] (-2 before the start: matches nothing)
    padded = torch.cat([torch.full((bs, hi), -2, dtype=seq.dtype, device=dev), seq], dim=1)
    eq = torch.ones(bs, L, dtype=torch.bool, device=dev)
    usable = idx < (length - 1)[:, None]  # [bs, L] ends with a token after them
    best_end = torch.full((bs,), -1, dtype=torch.long, device=dev)
    for i in range(hi):
        at = length - 1 - i  # [bs] index of the suffix's token i from the end
        tail = seq.gather(1, at.clamp(min=0)[:, None])  # [bs, 1]
        tail = torch.where(at[:, None] >= 0, tail, -3)  # shorter than n: matches nothing
        eq &= padded[:, hi - i : hi - i + L] == tail
        n = i + 1
        if n >= lo:
            end = torch.where(eq & usable, idx, -1).amax(dim=1)  # most recent, this n
            best_end = torch.where(end >= 0, end, best_end)  # longer n overrides shorter
    return best_end


def chain_tree(root_tokens: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """root [bs] + drafts [bs, k] -> the chain root -> d_1 -> ... -> d_k as a DraftTree."""
    bs, k = drafts.shape
    dev = drafts.device
    n = k + 1
    ids = torch.arange(n, device=dev)
    return DraftTree(
        tokens=torch.cat([root_tokens.long()[:, None], drafts.long()], dim=1),
        parents=(ids - 1).expand(bs, n).contiguous(),
        depth=ids.expand(bs, n).contiguous(),
        mask=(ids[None, :] <= ids[:, None]).expand(bs, n, n).contiguous(),
        scores=torch.zeros(bs, n, device=dev),
        max_depth=k,
    )


class TokenHistory:
    """One int64 per KV slot of the pool (the token after each position), plus a dump slot
    that masked writes go to."""

    def __init__(self, runner) -> None:
        self.page_size = runner.page_size
        num_slots = (runner.num_pages + 1) * runner.page_size  # the spare page included
        self.tokens = torch.full((num_slots + 1,), -1, dtype=torch.long, device=runner.device)
        self.dump = num_slots
        self.device = runner.device

    def write_host(self, starts: list[int], page_tables: list[list[int]],
                   next_tokens: list[list[int]], last: torch.Tensor | None = None) -> None:
        """Positions starts[r] .. starts[r] + len(next_tokens[r]) - 1 of row r get its tokens
        (last [rows], on the device: each row's final token, over the host's)."""
        ps = self.page_size
        slots = [
            pages[p // ps] * ps + p % ps
            for a, pages, toks in zip(starts, page_tables, next_tokens)
            for p in range(a, a + len(toks))
        ]
        if slots:
            values = torch.tensor([t for toks in next_tokens for t in toks], dtype=torch.long,
                                  device=self.device)
            if last is not None:
                ends = torch.tensor([len(t) for t in next_tokens], device=self.device).cumsum(0)
                values.index_copy_(0, ends - 1, last)
            self.tokens[torch.tensor(slots, device=self.device)] = values

    def write_emitted(self, result: VerifyResult, window: torch.Tensor,
                      valid: torch.Tensor) -> None:
        """A cycle's emitted tokens e_1 .. e_m follow positions P .. P + m - 1 (window [bs, L]:
        the slots of P ..); fixed shapes: the other columns write the dump slot."""
        w = min(result.emitted.shape[1], window.shape[1])
        cols = torch.arange(w, device=window.device)
        keep = (cols < result.num_emitted[:, None]) & valid[:, None]
        slots = torch.where(keep, window[:, :w], self.dump)
        self.tokens.index_put_((slots.reshape(-1),), result.emitted[:, :w].reshape(-1))

    def read(self, page_table: torch.Tensor, root_pos: torch.Tensor,
             root_tokens: torch.Tensor) -> torch.Tensor:
        """[bs, page_table width * page_size] tokens t_1 .. t_P of each row (the root token
        written at index P - 1 from root_tokens; past P: stale values the matcher masks)."""
        bs = page_table.shape[0]
        span = torch.arange(page_table.shape[1] * self.page_size, device=page_table.device)
        seq = self.tokens[kv_slots(page_table, span.expand(bs, -1), self.page_size)]
        at = (root_pos - 1).clamp(min=0)[:, None]
        return seq.scatter(1, at, root_tokens.long()[:, None])

    def lookup(self, page_table: torch.Tensor, root_pos: torch.Tensor,
               root_tokens: torch.Tensor, length: torch.Tensor, k: int, lo: int,
               hi: int) -> torch.Tensor:
        """ngram_match's drafts [bs, k] (-1: none) of each row's first `length` tokens, on
        CUDA through kernels/ngram_lookup.py (reads only those tokens), else over `read`."""
        if not (use_triton(page_table) or host_launches()):
            return ngram_match(self.read(page_table, root_pos, root_tokens), length, k, lo, hi)[0]
        best_end = ngram_ends(self.tokens, page_table, self.page_size, root_pos, root_tokens,
                              length, lo, hi)  # fmt: skip
        take, real = follow(best_end, length, k)
        limit = page_table.shape[1] * self.page_size - 1
        tokens = self.tokens[kv_slots(page_table, take.clamp(0, limit), self.page_size)]
        tokens = torch.where(take == (root_pos - 1)[:, None], root_tokens.long()[:, None], tokens)
        return torch.where(real, tokens, -1)


class NgramProposer:
    needs_target_features = False
    aux_layer_ids: tuple[int, ...] = ()
    keeps_state = True  # the history in the pages covers a prefix of the positions
    state_dim = 0
    state_dtype = torch.long
    num_kv_layers = 0
    kv_specs: tuple = ()
    # the pages hold t_{i+1} at position i: a function of the tokens alone
    prefix_cache_key = "next-token history"

    def __init__(self, spec, runner) -> None:  # spec: SpecConfig
        self.lo, self.hi = spec.lookup_range
        self.history = TokenHistory(runner)

    def scratch_slots(self, shape: DraftShape) -> int:
        return 0

    def propose(self, shape: DraftShape, state: torch.Tensor, root_pos: torch.Tensor,
                root_tokens: torch.Tensor, page_table: torch.Tensor,
                valid: torch.Tensor) -> DraftTree:
        assert shape.topk == 1, "ngram drafts chains"
        length = torch.where(valid, root_pos, 0)
        drafts = self.history.lookup(page_table, root_pos, root_tokens, length, shape.num_steps,
                                     self.lo, self.hi)  # fmt: skip
        # filler where nothing matched: the root token (any token is verified losslessly)
        drafts = torch.where(drafts >= 0, drafts, root_tokens.long()[:, None])
        return chain_tree(root_tokens, drafts)

    def extend_accepted(self, shape: DraftShape, result: VerifyResult,
                        feats: torch.Tensor | None, root_pos: torch.Tensor,
                        page_table: torch.Tensor, valid: torch.Tensor,
                        window: torch.Tensor) -> torch.Tensor:
        self.history.write_emitted(result, window, valid)
        return torch.zeros(root_pos.shape[0], 0, dtype=self.state_dtype, device=root_pos.device)

    def extend(self, starts: list[int], page_tables: list[list[int]],
               next_tokens: list[list[int]], feats: torch.Tensor | None,
               last: torch.Tensor | None = None) -> torch.Tensor:
        self.history.write_host(starts, page_tables, next_tokens, last)
        return torch.zeros(len(starts), 0, dtype=self.state_dtype, device=self.history.device)

    def release(self, request_id: str) -> None:
        pass  # everything lives in the request's pages
