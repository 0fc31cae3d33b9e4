"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, GLM-5) over a
paged latent cache.

Per token, with H hidden, N heads (local to this TP rank), P = qk_nope_head_dim,
R = qk_rope_head_dim, V = v_head_dim, L = kv_lora_rank:

    q          = q_b_proj(q_a_layernorm(q_a_proj(x)))   (q_proj(x) without q_lora_rank)
                 -> [T, N, P + R] = [q_nope | q_pe]
    c_kv, k_pe = kv_a_proj_with_mqa(x) -> [L | R];  c_kv = kv_a_layernorm(c_kv)   (ONE head)
    rope       q_pe and k_pe rotated at the token's position (yarn: cos/sin carry mscale ratio)
    cache      one latent row [c_kv | k_pe] = L + R values per token and layer (KVCacheSpec.mla)
    W_UK, W_UV = kv_b_proj.weight.view(N, P + V, L).split([P, V], 1)  # [N, P, L], [N, V, L]

Two exact forms of the same attention (softmax over scores * scale):

    compute    K_n = [c W_UK[n]^T | k_pe], V_n = c W_UV[n]^T for every cached token of the
               batch, then MHA with qk dim P + R and v dim V
    absorbed   q_lat = q_nope W_UK (per head), then MQA over the latent rows with qk dim
               L + R and v dim L: o_lat = softmax((q_lat . c + q_pe . k_pe) scale) c, and
               o = o_lat W_UV^T

`choose_form` picks, per forward, the one with fewer FLOPs: a prefill chunk pays the
expansion of its request's cached tokens once (L (P + V) per token and head) and then 320 per
(query, key) pair and head at DeepSeek-V3 dims, where the absorbed form pays 1088 per pair;
decode, verify and short extends after a long context take the absorbed form (no expansion,
the cache read once). A custom mask (tree verify), or a batch without host lengths (a
CUDA-graph capture), always takes the absorbed form: its launches depend on no per-step host
value. So does every forward in exact mode (EngineConfig.exact), where the W_UK / W_UV products
run M-invariant (kernels/exact_gemm.exact_bmm) and the kernel a fixed launch plan. Attention output o [T, N, V] goes through o_proj (row-parallel: one all-reduce).

softmax scale = (P + R)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under yarn (the
correction for the attention factor yarn applies to cos/sin).

Tensor parallelism is over heads: q_b_proj / q_proj and kv_b_proj are column-parallel,
o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa, the two latent norms and the latent cache
are the same on every rank.

Interface for model code (DeepseekV3 / Kimi decoder layers):
    rotary = mla_rotary(config)                 # one RotaryEmbedding over R dims, shared
    attn = MLAAttention(config, layer_idx, rotary)   # config.mla set (ModelConfig.from_hf)
    out = attn(positions, hidden)               # [T] int64, [T, H] -> [T, H]
Parameter names are the checkpoint's under `self_attn.` (q_a_proj, q_a_layernorm, q_b_proj or
q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; biases iff attention_bias),
each with its `weight_loader`, so `load_weights` passes them through unchanged. W_UK / W_UV
are views of kv_b_proj.weight taken at each forward. With a quantized checkpoint the
projections take the format its config gives them, except kv_b_proj: it loads in that format
and is dequantized to the activation dtype after loading (its only post-processing step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from specserve.config import MLAConfig, ModelConfig
from specserve.distributed.parallel_state import get_tp_size
from specserve.kernels.dispatch import EXACT
from specserve.kernels.exact_gemm import exact_bmm
from specserve.kernels.mla_attention import uncached_layout
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention import CachedAttention
from specserve.layers.attention_metadata import AttentionMetadata, get_forward_context
from specserve.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from specserve.layers.norm import RMSNorm
from specserve.layers.quantization.base import QuantConfig, child
from specserve.layers.rotary import RotaryEmbedding, yarn_mscale

# q_a_layernorm / kv_a_layernorm: RMSNorm's default eps in transformers and the reference
# code, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6
# the compute form expands every cached token of the batch to N (P + R + V) values; past this
# many values the absorbed form runs instead (same result, no expansion buffer)
COMPUTE_FORM_MAX_VALUES = 1 << 29
FORMS = ("auto", "compute", "absorbed")

Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MLABackend(Protocol):
    """What an attention backend offers MLA layers, as its `mla` attribute."""

    def rope_and_store(
        self,
        positions: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cos_sin: torch.Tensor,
        interleaved: bool,
        latent_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Rotate q_pe [T, N, R] in place; write [c_kv [T, L] | rot(k_pe) [T, R]] at
        slot_mapping (-1: no write) of latent_cache [pages, page_size, L + R]."""
        ...

    def absorbed(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q_lat [T, N, L], q_pe [T, N, R] over the cache (causal or md.custom_mask) ->
        o_lat [T, N, L]."""
        ...

    def compute(
        self,
        q: torch.Tensor,
        latent_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        kv_lora_rank: int,
        expand: Expand,
    ) -> torch.Tensor:
        """q [T, N, P + R] over K/V expanded from the cached latents of each request
        (expand(c [S, L]) -> k_nope [S, N, P], v [S, N, V]) -> o [T, N, V]."""
        ...


def mla_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The RoPE over the R rope dims of an MLA model (shared by its layers)."""
    assert config.mla is not None
    return RotaryEmbedding(
        config.mla.qk_rope_head_dim,
        config.max_position_embeddings,
        config.rope_theta,
        config.rope_scaling,
    )


def mla_softmax_scale(mla: MLAConfig, rope_scaling: dict | None) -> float:
    """(P + R)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under a scaled rope with
    mscale_all_dim set (DeepSeek-V3 factor 40: 0.13523; Kimi K2 factor 32: 0.13086)."""
    scale = mla.qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("rope_type", "default") != "default":
        m_all = rope_scaling.get("mscale_all_dim") or 0.0
        if m_all:
            scale *= yarn_mscale(rope_scaling["factor"], m_all) ** 2
    return scale


def choose_form(md: AttentionMetadata, num_heads: int, mla: MLAConfig) -> str:
    """'compute' or 'absorbed' for this forward (see the module docstring): the form with
    fewer FLOPs per head, counting (query, key) pairs, the expansion of cached tokens (compute)
    and the q/o absorption of new tokens (absorbed)."""
    if (md.custom_mask is not None or md.query_lens_cpu is None or md.seq_lens_cpu is None
            or EXACT.attention):  # exact mode: prefill, decode and verify share one form
        return "absorbed"
    rank, nope, rope, v = (
        mla.kv_lora_rank,
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.v_head_dim,
    )
    kv_tokens = sum(md.seq_lens_cpu)
    if kv_tokens * num_heads * (nope + rope + v) > COMPUTE_FORM_MAX_VALUES:
        return "absorbed"
    pairs = sum(q * s for q, s in zip(md.query_lens_cpu, md.seq_lens_cpu))
    compute = pairs * (nope + rope + v) + kv_tokens * rank * (nope + v)
    absorbed = pairs * (2 * rank + rope) + sum(md.query_lens_cpu) * rank * (nope + v)
    return "compute" if compute < absorbed else "absorbed"


class MLAAttention(CachedAttention):
    """One layer's multi-head latent attention (module docstring); `latent_cache`
    [num_pages, page_size, L + R] is set by KVPool.bind. `form` fixes the attention form
    ('compute' / 'absorbed', e.g. for tests and benchmarks) instead of `choose_form`.
    reduce_output=False leaves o_proj's TP partial sum to the caller (the decoder layer)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None = None,
        form: str = "auto",
        reduce_output: bool = True,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError(
                f"{config.architecture}: MLAAttention needs the config's MLA "
                "fields (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, ...)"
            )
        if form not in FORMS:
            raise ValueError(f"MLA form must be one of {FORMS}, got {form!r}")
        m = self.mla = config.mla
        if m.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {m.qk_rope_head_dim}")
        h, bias = config.hidden_size, config.attention_bias
        self.layer_idx = layer_idx
        self.form = form
        self.num_heads = divide(config.num_heads, get_tp_size(), "num_heads")
        q_out = config.num_heads * m.qk_head_dim
        qc = quant_config

        def name(leaf: str) -> str:
            return child(prefix, leaf)

        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, False, qc, name("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, bias, qc, name("q_a_proj"))
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, q_out, False, qc, name("q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            h, m.kv_lora_rank + m.qk_rope_head_dim, bias, qc, name("kv_a_proj_with_mqa")
        )
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        if m.q_lora_rank is not None:
            self.q_a_layernorm.feeds(self.q_b_proj)
        # read as W_UK / W_UV: a quantized checkpoint's kv_b_proj is dequantized once loaded
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, config.num_heads * (m.qk_nope_head_dim + m.v_head_dim), False, qc,
            name("kv_b_proj"), dequantize_after_loading=True,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_heads * m.v_head_dim, h, bias, qc,
                                        name("o_proj"), reduce_output=reduce_output)  # fmt: skip
        self.rotary = rotary if rotary is not None else mla_rotary(config)
        assert self.rotary.head_dim == m.qk_rope_head_dim
        self.scale = mla_softmax_scale(m, config.rope_scaling)
        self.latent_cache = torch.empty(0)

    @property
    def input_projs(self) -> tuple:
        """The linears that read the attention's whole input (the norm before it feeds them)."""
        q = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        return (q, self.kv_a_proj_with_mqa)

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec.mla(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)

    def absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [N, P, L], W_UV [N, V, L]): views of kv_b_proj.weight (this rank's heads)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(
            self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank
        )
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def expand(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [S, L] -> (k_nope [S, N, P], v [S, N, V]), the compute form's K/V."""
        kv = self.kv_b_proj(c_kv).view(c_kv.shape[0], self.num_heads, -1)
        return kv.split([self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # positions [T], hidden [T, H] -> [T, H]
        q, _ = self.queries(hidden)
        ops, cache, md = self.rope_and_store(positions, hidden, q)
        return self.output(self.attend(ops, q, cache, md))

    def queries(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q [T, N, P + R], the normed q latent [T, q_lora_rank] or None without one)."""
        if self.mla.q_lora_rank is None:
            q_resid, q = None, self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim), q_resid

    def rope_and_store(
        self, positions: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor
    ) -> tuple[MLABackend, torch.Tensor, AttentionMetadata]:
        """Rotate q's rope part in place and write this forward's latent rows; returns the
        backend's MLA ops, the latent cache and the metadata addressing it (a scratch cache
        of the new tokens when no pool is bound)."""
        m = self.mla
        kv = self.kv_a_proj_with_mqa(hidden)  # [T, L + R]
        c_kv = self.kv_a_layernorm(kv[:, : m.kv_lora_rank].contiguous())  # [T, L]
        k_pe = kv[:, m.kv_lora_rank :]  # [T, R]
        ctx = get_forward_context()
        ops: MLABackend | None = getattr(ctx.backend, "mla", None)
        if ops is None:
            raise ValueError(
                f"the {getattr(ctx.backend, 'name', '?')} attention backend has no MLA support"
            )
        cache, md = self.latent_cache, ctx.metadata
        if cache.numel() == 0:  # no pool bound: the new tokens are the whole KV
            cache, md = self._uncached(md, hidden)
        # q_pe is a view of q: rotated in place, q is the compute form's query as it stands
        q_pe = q[..., m.qk_nope_head_dim :]
        ops.rope_and_store(positions, q_pe, c_kv, k_pe, self.rotary.table(), m.rope_interleave,
                           cache, md.slot_mapping)  # fmt: skip
        return ops, cache, md

    def attend(
        self, ops: MLABackend, q: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Dense attention of q [T, N, P + R] over the cache, in the chosen form: o [T, N, V]."""
        form = self.form if self.form != "auto" else choose_form(md, self.num_heads, self.mla)
        if form == "compute":
            return ops.compute(q, cache, md, self.scale, self.mla.kv_lora_rank, self.expand)
        q_nope, q_pe = q.split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], dim=-1)
        return self.unabsorb(ops.absorbed(self.absorb(q_nope), q_pe, cache, md, self.scale))

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, N, P] -> q_lat = q_nope W_UK [T, N, L]."""
        w_uk, _ = self.absorb_weights()
        if EXACT.on:  # M-invariant: a row's q_lat does not depend on the rows beside it
            return exact_bmm(q_nope, w_uk.transpose(1, 2))
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def unabsorb(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, N, L] -> o = o_lat W_UV^T [T, N, V]."""
        _, w_uv = self.absorb_weights()
        if EXACT.on:
            return exact_bmm(o_lat, w_uv)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, N, V] -> o_proj [T, H] (this rank's partial sum without reduce_output)."""
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.mla.v_head_dim))

    def _uncached(
        self, md: AttentionMetadata, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """A scratch cache of one-token pages holding this forward's tokens, and metadata
        addressing it (every request must be a fresh prefill)."""
        if md.query_lens_cpu is not None and md.seq_lens_cpu is not None:
            assert md.query_lens_cpu == md.seq_lens_cpu, (
                "without a KV cache every request must be a fresh prefill"
            )
        t = hidden.shape[0]
        cache = hidden.new_zeros(t, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        slots, page_table = uncached_layout(t, md.query_start_loc, md.max_query_len)
        md = dataclasses.replace(
            md,
            slot_mapping=slots,
            page_table=page_table,
            seq_lens=md.query_start_loc.diff().int(),
            seq_lens_cpu=md.query_lens_cpu,
        )
        return cache, md
