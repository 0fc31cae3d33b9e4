"""Host-side batch planning -> device tensors for one forward (see AttentionMetadata)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.layers.attention_metadata import AttentionMetadata


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata for a batch where request r runs query_lens[r] new tokens and holds
    seq_lens[r] KV positions after this forward's writes.

    The new tokens are the LAST query_lens[r] positions of r, so new token i of r is written
    at position p = seq_lens[r] - query_lens[r] + i, slot = page_tables[r][p // ps] * ps + p % ps.
    """
    bs = len(query_lens)
    assert bs > 0 and len(seq_lens) == bs and len(page_tables) == bs
    slots: list[int] = []
    for q_len, seq_len, pages in zip(query_lens, seq_lens, page_tables):
        assert 0 <= q_len <= seq_len, f"query length {q_len} exceeds KV length {seq_len}"
        assert len(pages) * page_size >= seq_len, "page table too short for the KV length"
        for pos in range(seq_len - q_len, seq_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    max_pages = max(1, max(len(p) for p in page_tables))
    table = [list(p) + [-1] * (max_pages - len(p)) for p in page_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    if custom_mask is not None:
        max_q = max(query_lens)
        assert custom_mask.shape[0] == bs and custom_mask.shape[1] >= max_q
        custom_mask = custom_mask.to(device=device, dtype=torch.bool)
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        query_start_loc=to_device(starts, torch.int32, device),
        seq_lens=to_device(list(seq_lens), torch.int32, device),
        page_table=to_device(table, torch.int32, device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        custom_mask=custom_mask,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def build_positions(
    query_lens: list[int], seq_lens: list[int], device: torch.device | str
) -> torch.Tensor:
    """Positions [T] of the new tokens of a linear (non-tree) batch: the last query_lens[r]
    positions of each request."""
    positions: list[int] = []
    for q_len, seq_len in zip(query_lens, seq_lens):
        positions.extend(range(seq_len - q_len, seq_len))
    return to_device(positions, torch.int64, device)


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list on the device without a sync (pinned staging, non-blocking copy)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class BatchInputs:
    """Device tensors for one forward over a set of scheduled requests."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    sample_rows: torch.Tensor  # [n_sample] rows of the hidden states to turn into logits
    sample_index: list[int]  # which scheduled entries sample, in sample_rows order


def prepare_batch(step, page_size: int, device: torch.device) -> BatchInputs:  # noqa: ANN001
    """A StepInput's arrays as the device tensors of one forward (step: StepInput)."""
    sample_index = np.flatnonzero(step.samples)
    md = build_attention_metadata(step.num_new_tokens.tolist(), step.seq_lens.tolist(),
                                  step.page_lists(), page_size, device)  # fmt: skip
    return BatchInputs(
        input_ids=to_device(step.token_ids, torch.long, device),
        positions=to_device(step.positions(), torch.long, device),
        md=md,
        sample_rows=to_device(step.tok_off[1:][sample_index] - 1, torch.long, device),
        sample_index=sample_index.tolist(),
    )
