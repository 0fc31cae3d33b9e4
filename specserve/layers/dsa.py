"""DeepSeek sparse attention (DSA: GLM-5, the DeepSeek-V3.2 design): MLA (layers/mla.py) whose
queries attend only to the `index_topk` cached tokens a lightning indexer picks for each.

Per layer, with x [T, H] the layer's normed input and q_resid = q_a_layernorm(q_a_proj(x)):

    k_I   = LayerNorm(wk(x))                        [T, dI]  one key per token, cached
    q_I   = wq_b(q_resid)                           [T, nI, dI]
    rope  on the first R = qk_rope_head_dim dims of q_I and k_I (GLM: interleaved pairs), at
          the token's position, with the MLA layer's cos/sin table
    w     = weights_proj(x) * nI^-0.5 * dI^-0.5     [T, nI]
    score[t, s] = sum_h w[t, h] relu(q_I[t, h] . k_I[s])   over the visible positions s
    attend (absorbed MLA) over the top index_topk positions of each query only

Exactness: a query that sees at most index_topk positions selects all of them, so while every
sequence of a forward is at most index_topk long (md.max_seq_len, a host int) the layer runs
plain dense MLA, bit for bit the MLA path, and skips the indexer's query side; the index keys
are written always (a later, longer step needs every token's). Past it the selection runs:
kernels/dsa_index.py (scores), kernels/dsa_select.py (top-k -> slots) and
kernels/sparse_mla.py (attention over the slots), Triton on the GPU backend, the torch
references on the reference backend; both are CUDA-graph safe, and the Triton kernels' work
follows the requests' lengths, not the graph's page-table width (the context limit). A captured graph's metadata carries max_seq_len = the graph's position bound,
so graphs of an engine whose context exceeds index_topk hold the sparse path (exact for short
sequences too: every visible position is selected).

A "shared" layer (config indexer_types) has no indexer and no index keys: it attends over the
slots the previous "full" layer selected in the same forward (`DSASelection`). The MTP / NextN
layer (models/mtp_layer.py) is always full: it runs in a forward of its own, with no earlier
layer to share a selection with (`full=True`, its own DSASelection).

Cache: a full layer keeps KVCacheSpec.dsa (latent + index_k), a shared layer KVCacheSpec.mla.
The index-key row is [k_I pass dims (dI - R) | rotated rope dims (R)], the row layout
kernels/mla_store.py writes, so one store kernel serves the latent and the index keys; the
indexer query is put in that order before scoring. The indexer is replicated under tensor
parallelism: every rank selects the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention_metadata import AttentionMetadata, get_forward_context
from specserve.layers.linear import ReplicatedLinear, default_weight_loader
from specserve.layers.mla import MLAAttention, MLABackend
from specserve.layers.quantization.base import QuantConfig, child
from specserve.layers.rotary import RotaryEmbedding

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (a LayerNorm), whatever rms_norm_eps says
# a long prefill is scored in chunks of tokens: at most this many fp32 scores at once
SCORE_CHUNK_VALUES = 1 << 26
FORMS = ("auto", "compute", "absorbed", "sparse")


class DSABackend(Protocol):
    """What an attention backend offers DSA layers, as its `dsa` attribute."""

    def index_scores(
        self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, md: AttentionMetadata,
        first_token: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, nI, dI] (cache dim order), w [T, nI] fp32 of the batch's tokens first_token
        .. first_token + T - 1 -> scores [T, width] fp32, -inf where not visible (width =
        page_table columns * page_size; columns at or past a token's request length may be
        left unwritten)."""
        ...

    def select(
        self, q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, md: AttentionMetadata,
        k: int, first_token: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """index_scores, then each token's top-k visible positions as cache slots [T, k]
        int64 in ascending position order, -1 after them (kernels/dsa_index.py:
        select_slots)."""
        ...

    def sparse_absorbed(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q_lat [T, N, L], q_pe [T, N, R] over slots [T, k] (-1: none) -> o_lat [T, N, L]."""
        ...


@dataclass
class DSASelection:
    """The slots the last full DSA layer of the running forward selected, for the shared
    layers after it (one per model)."""

    slots: torch.Tensor | None = None  # [T, k] int64


class Indexer(nn.Module):
    """The lightning indexer's projections (checkpoint names under `self_attn.indexer.`;
    `prefix`: that module's name, which the quantization config picks formats by)."""

    def __init__(
        self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        assert config.dsa is not None and config.mla is not None
        d, q_lora = config.dsa, config.mla.q_lora_rank
        if q_lora is None:
            raise ValueError(f"{config.architecture}: the DSA indexer reads the q latent; "
                             "config.json must set q_lora_rank")  # fmt: skip
        if d.index_head_dim < config.mla.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({d.index_head_dim}) must be >= qk_rope_head_dim "
                f"({config.mla.qk_rope_head_dim}): the indexer rotates that many dims"
            )
        self.num_heads, self.head_dim = d.index_n_heads, d.index_head_dim
        qc = quant_config
        self.wq_b = ReplicatedLinear(q_lora, d.index_n_heads * d.index_head_dim, False, qc,
                                     child(prefix, "wq_b"))  # fmt: skip
        self.wk = ReplicatedLinear(config.hidden_size, d.index_head_dim, False, qc,
                                   child(prefix, "wk"))  # fmt: skip
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=INDEX_NORM_EPS)
        for p in self.k_norm.parameters():
            p.requires_grad_(False)
            p.weight_loader = default_weight_loader
        self.weights_proj = ReplicatedLinear(config.hidden_size, d.index_n_heads, False, qc,
                                             child(prefix, "weights_proj"))  # fmt: skip
        self.weight_scale = (d.index_n_heads * d.index_head_dim) ** -0.5

    def key(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(hidden))  # [T, dI]

    def query(self, q_resid: torch.Tensor) -> torch.Tensor:
        return self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)  # [T, nI, dI]

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(hidden).float() * self.weight_scale  # [T, nI]


class DSAAttention(MLAAttention):
    """One MLA layer with DeepSeek sparse attention (module docstring). form: "sparse" forces
    the selection path (tests, benchmarks), the MLA forms fix the dense path's form. full:
    whether the layer runs its own indexer (None: config indexer_types at layer_idx)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        selection: DSASelection,
        form: str = "auto",
        reduce_output: bool = True,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        full: bool | None = None,
    ) -> None:
        if form not in FORMS:
            raise ValueError(f"DSA form must be one of {FORMS}, got {form!r}")
        super().__init__(config, layer_idx, rotary, "auto" if form == "sparse" else form,
                         reduce_output, quant_config, prefix)  # fmt: skip
        assert config.dsa is not None
        self.dsa = config.dsa
        self.force_sparse = form == "sparse"
        self.selection = selection
        self.indexer = None
        if config.dsa.runs_indexer(layer_idx) if full is None else full:
            self.indexer = Indexer(config, quant_config, child(prefix, "indexer"))
        self.index_k_cache = torch.empty(0)

    @property
    def kv_spec(self) -> KVCacheSpec:
        m = self.mla
        if self.indexer is None:
            return KVCacheSpec.mla(m.kv_lora_rank, m.qk_rope_head_dim)
        return KVCacheSpec.dsa(m.kv_lora_rank, m.qk_rope_head_dim, self.dsa.index_head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # positions [T], hidden [T, H] -> [T, H]
        q, q_resid = self.queries(hidden)
        ops, cache, md = self.rope_and_store(positions, hidden, q)
        sparse = self.force_sparse or md.max_seq_len > self.dsa.index_topk
        slots = None
        if self.indexer is not None:
            slots = self._index(ops, positions, hidden, q_resid, md, sparse)
            self.selection.slots = slots
        if not sparse:
            return self.output(self.attend(ops, q, cache, md))
        if slots is None:
            slots = self.selection.slots
            assert slots is not None, "a shared DSA layer runs after a full one"
        q_nope, q_pe = q.split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], dim=-1)
        o_lat = _dsa_ops().sparse_absorbed(self.absorb(q_nope), q_pe, cache, slots, self.scale)
        return self.output(self.unabsorb(o_lat))

    def _index(
        self, ops: MLABackend, positions: torch.Tensor, hidden: torch.Tensor,
        q_resid: torch.Tensor, md: AttentionMetadata, sparse: bool,
    ) -> torch.Tensor | None:  # fmt: skip
        """Write the index keys of this forward's tokens; with `sparse`, select each query's
        slots ([T, k] int64, -1: none)."""
        assert self.indexer is not None
        rope = self.mla.qk_rope_head_dim
        k_idx = self.indexer.key(hidden)  # [T, dI]
        t = hidden.shape[0]
        q_idx = self.indexer.query(q_resid) if sparse else k_idx.new_empty(t, 0, rope)
        cache = self.index_k_cache
        if cache.numel() == 0:  # no pool bound (rope_and_store addressed a scratch cache)
            cache = hidden.new_zeros(t, 1, self.dsa.index_head_dim)
        # rotates q_idx's rope dims in place; writes [k pass | rot(k rope)] at the token slots
        ops.rope_and_store(positions, q_idx[..., :rope], k_idx[:, rope:], k_idx[:, :rope],
                           self.rotary.table(), self.dsa.rope_interleave, cache,
                           md.slot_mapping)  # fmt: skip
        if not sparse:
            return None
        q_idx = torch.cat([q_idx[..., rope:], q_idx[..., :rope]], dim=-1)  # the cache's order
        w = self.indexer.head_weights(hidden)
        width = md.page_table.shape[1] * cache.shape[1]
        k = min(self.dsa.index_topk, width)  # a narrower table: every position fits
        dsa_ops = _dsa_ops()
        chunk = max(1, SCORE_CHUNK_VALUES // width)  # host ints: one chunk in decode graphs
        slots = []
        for a in range(0, t, chunk):
            slots.append(dsa_ops.select(q_idx[a : a + chunk], w[a : a + chunk], cache, md, k, a))
        return slots[0] if len(slots) == 1 else torch.cat(slots)


def _dsa_ops() -> DSABackend:
    backend = get_forward_context().backend
    ops = getattr(backend, "dsa", None)
    if ops is None:
        raise ValueError(f"the {getattr(backend, 'name', '?')} attention backend has no DSA "
                         "(sparse attention) support")  # fmt: skip
    return ops
