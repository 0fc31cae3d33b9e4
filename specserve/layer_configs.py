"""The nested parts of a model's configuration, one per layer kind: MoE (routing and expert
dims), MLA (latent attention dims) and DSA (the sparse-attention indexer), each read from a
Hugging Face config dict in either spelling (hub config.json or transformers-saved). Part of
`model_config.ModelConfig`. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def hf_field(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of `names` present (and not null) in `hf`: one field, several
    spellings (hub config.json vs transformers' saved names)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


MOE_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi K2, GLM-4.5+).

    Routing: sigmoid (or softmax) scores; `noaux_tc` adds e_score_correction_bias for the
    selection only; n_group / topk_group restrict the choice to the best groups; weights from
    the unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor.
    """

    num_experts: int  # routed experts
    num_experts_per_tok: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int = 0  # one shared MLP of intermediate_size * num_shared_experts
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    first_k_dense_replace: int = 0  # layers below this one have a dense MLP
    moe_layer_freq: int = 1  # a layer at or past first_k_dense_replace is MoE if i % freq == 0
    # explicit per-layer kinds ("dense" / "sparse"), when a config gives them
    mlp_layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"scoring_func must be 'sigmoid' or 'softmax', got {self.scoring_func!r}"
            )
        if self.topk_method not in MOE_TOPK_METHODS:
            raise ValueError(
                f"topk_method must be one of {MOE_TOPK_METHODS}, got {self.topk_method!r}"
            )
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) "
                f"and 1 <= topk_group ({self.topk_group}) <= n_group"
            )
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError("noaux_tc group scores sum the top 2 experts: need >= 2 per group")
        if not 0 < self.num_experts_per_tok <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be >= 1 and at most the "
                f"experts of the topk_group kept groups ({self.topk_group * per_group})"
            )

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_idx] == "sparse"
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        """The MoE fields of a config.json (hub or transformers-saved spelling); None if the
        model has no routed experts."""
        num_experts = hf_field(hf, "n_routed_experts", "num_local_experts", "num_experts")
        if not num_experts:
            return None
        method = hf_field(hf, "topk_method", default="noaux_tc")
        scoring = hf_field(
            hf, "scoring_func", default="sigmoid" if method == "noaux_tc" else "softmax"
        )
        layer_types = hf.get("mlp_layer_types")
        return cls(
            num_experts=int(num_experts),
            num_experts_per_tok=int(hf_field(hf, "num_experts_per_tok", "moe_top_k", default=1)),
            intermediate_size=int(hf_field(hf, "moe_intermediate_size", "intermediate_size")),
            num_shared_experts=int(hf_field(hf, "n_shared_experts", "num_shared_experts", default=0)),
            n_group=int(hf_field(hf, "n_group", default=1)),
            topk_group=int(hf_field(hf, "topk_group", default=1)),
            norm_topk_prob=bool(hf_field(hf, "norm_topk_prob", default=method == "noaux_tc")),
            routed_scaling_factor=float(hf_field(hf, "routed_scaling_factor", default=1.0)),
            scoring_func=str(scoring),
            topk_method=str(method),
            first_k_dense_replace=int(hf_field(hf, "first_k_dense_replace", default=0)),
            moe_layer_freq=int(hf_field(hf, "moe_layer_freq", default=1)),
            mlp_layer_types=tuple(layer_types) if layer_types else None,
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dims (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, GLM-5).

    Per token: q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None) gives
    every head qk_nope + qk_rope dims; kv_a_proj_with_mqa(x) gives one latent c_kv
    (kv_lora_rank, normed) and one shared rope key k_pe (qk_rope); kv_b_proj maps c_kv to each
    head's k_nope (qk_nope) and v (v_head_dim). See layers/mla.py."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # rope dims stored as interleaved pairs (2i, 2i+1), GPT-J style

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig | None:
        """The MLA fields of a (text) config.json, or None for a model without MLA."""
        if hf.get("kv_lora_rank") is None:
            return None
        q_lora = hf.get("q_lora_rank")
        return cls(
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )


INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): an MLA layer's lightning indexer
    scores every cached token for each query and the attention reads only the top
    `index_topk` of them (layers/dsa.py). A "shared" layer reuses the selection of the
    previous "full" layer instead of running its own indexer (GLM-5.2's indexer_types)."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...] | None = None  # per layer; None: every layer "full"
    rope_interleave: bool = True  # the indexer's rope dims as pairs (2i, 2i+1) (GLM)

    def __post_init__(self) -> None:
        if self.index_topk < 1 or self.index_head_dim < 1 or self.index_n_heads < 1:
            raise ValueError(
                f"index_topk ({self.index_topk}), index_head_dim ({self.index_head_dim}) and "
                f"index_n_heads ({self.index_n_heads}) must be >= 1"
            )
        types = self.indexer_types or ()
        if any(t not in INDEXER_TYPES for t in types) or types[:1] == ("shared",):
            raise ValueError(
                f"indexer_types must be 'full' or 'shared' per layer, the first 'full'; got "
                f"{list(types)}"
            )

    def runs_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types is None or self.indexer_types[layer_idx] == "full"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DSAConfig | None:
        """The DSA fields of a (text) config.json, or None for a model without an indexer."""
        if hf.get("index_topk") is None:
            return None
        types = hf.get("indexer_types")
        return cls(
            index_topk=int(hf["index_topk"]),
            index_head_dim=int(hf["index_head_dim"]),
            index_n_heads=int(hf["index_n_heads"]),
            indexer_types=tuple(types) if types else None,
            rope_interleave=bool(hf.get("indexer_rope_interleave", True)),
        )
