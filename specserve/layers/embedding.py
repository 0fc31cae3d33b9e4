"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of tp_size and split in equal blocks: rank r owns ids
[r * shard, (r + 1) * shard) with shard = ceil(vocab / tp). Padding rows are zero and their
logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.comm import all_gather, all_reduce
from specserve.distributed.parallel_state import get_tp_rank, get_tp_size
from specserve.layers.quantization.unquantized import dense_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)  # ceil
        self.vocab_start = self.tp_rank * self.shard_size
        # rows of the real vocabulary this rank owns (the rest of the shard is padding)
        self.num_real = max(0, min(self.shard_size, num_embeddings - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is None
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"the model expects {expected}"
            )
        param.data.zero_()
        rows = loaded.narrow(0, self.vocab_start, self.num_real)
        param.data[: self.num_real].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [T] -> [T, embedding_dim]; at TP 1 the all-reduce is a no-op (or the
        # communication-cost emulator's wait)
        if self.tp_size == 1:
            return all_reduce(F.embedding(input_ids, self.weight))
        # masked lookup: ids outside this rank's block read row 0 and are zeroed, then summed
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.shard_size)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary; may share its weight with the embedding."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [n, H] -> local [n, shard] -> gathered [n, tp * shard] -> [n, vocab]
        logits = dense_linear(hidden, self.weight)  # exact mode, a measured plan or cuBLAS
        if self.tp_size > 1:
            logits = all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
