"""What every attention backend receives for one forward: the batch layout over the paged KV.

Index diagram for a batch of two requests (page_size 4):

    tokens of this forward   q0 q1 q2 | q3              query_start_loc = [0, 3, 4]
    request 0: 5 cached tokens + 3 new  -> seq_lens[0] = 8 (KV length after the write)
    request 1: 9 cached tokens + 1 new  -> seq_lens[1] = 10
    page_table[r, i] = physical page of request r's logical page i (-1 past the end)
    slot_mapping[t]  = page * page_size + offset where token t's K/V is written (-1: skip)

Masking: the new tokens of request r are the LAST q_len_r entries of its KV. With
`custom_mask is None` they are causal (query i sees KV [0, seq_len - q_len + i]). With a custom
mask of width W = custom_mask.shape[-1] (W >= max_query_len), the LAST W KV entries of each
request are governed by the mask and everything before them is visible: query i sees
[0, seq_len - W) plus KV entry seq_len - W + j iff custom_mask[r, i, j]. Tree verify uses
W = q_len (the draft tokens themselves); a draft tree step uses W = all scratch tokens written
so far in the cycle (its ancestors sit among them). Rows of requests with fewer than
max_query_len queries are padding and must be ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [bs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [bs] int32, KV length per request after this step's writes
    page_table: torch.Tensor  # [bs, max_pages] int32
    max_query_len: int  # host ints, known when the batch is planned
    max_seq_len: int
    custom_mask: torch.Tensor | None = None  # [bs, max_query_len, W] bool, see above
    # host copies (lists) for backends that loop on the CPU; filled by the planner
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # [NB, 2] int32 (request, query block) of a token-bucket CUDA graph's padded batch: the
    # attention grid follows it (kernels/paged_attention.py; worker/token_graphs.py)
    block_table: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every request runs exactly one new token (the CUDA-graph decode shape)."""
        return self.max_query_len == 1


@dataclass
class SplitMetadata:
    """One forward whose tokens fall in consecutive ranges, each attending with its own
    metadata (prefill chunks causal, a draft tree's nodes under their ancestor mask): every
    layer but attention runs once over all the tokens; attention runs once a range. Only
    `Attention` (MHA/GQA) takes it (`Attention.takes_split`)."""

    parts: list[tuple[int, int, AttentionMetadata]]  # (first token, end token, metadata)

    @property
    def max_seq_len(self) -> int:  # what the rotary table must cover
        return max(md.max_seq_len for _, _, md in self.parts)


@dataclass
class ForwardContext:
    metadata: AttentionMetadata | None
    backend: object  # an AttentionBackend


_CONTEXT: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_forward_context() -> ForwardContext:
    assert _CONTEXT is not None, "attention called outside a forward context"
    return _CONTEXT
