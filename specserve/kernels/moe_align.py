"""Token-expert alignment of the fused MoE (kernels/fused_moe.py): the (token, expert) pairs
sorted by expert, each expert's run padded to whole blocks of the grouped GEMM's BLOCK_M."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEAlignment:
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32: pair ids, num_pairs = padding
    block_expert: torch.Tensor  # [num_blocks] int32: the expert of each block (-1: unused)
    num_padded: torch.Tensor  # [1] int32: rows in use (blocks past it return at once)
    block_m: int


def align_pairs(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoEAlignment:
    """Sort the (token, expert) pairs by expert, each expert's run padded to whole blocks."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.flatten().long()  # [P] expert of pair p
    if num_pairs * 4 <= num_experts:  # one pair per block
        sorted_ids = torch.full((num_pairs * block_m,), num_pairs, dtype=torch.int32, device=dev)
        sorted_ids[::block_m] = torch.arange(num_pairs, dtype=torch.int32, device=dev)
        num_padded = torch.full((1,), num_pairs * block_m, dtype=torch.int32, device=dev)
        return MoEAlignment(sorted_ids, flat.int(), num_padded, block_m)
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no bincount: its size syncs
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] end row of each expert's run
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, in pair order
    expert = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[ends[expert] - padded[expert] + rank] = order.int()
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)  # E past the last run
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return MoEAlignment(sorted_ids, block_expert, ends[-1:].int(), block_m)
