"""DeepSeek-style expert selection in one launch (Triton), with its torch reference.

For router logits l [T, E] (fp32), per token:

    s      = sigmoid(l)  (or softmax(l))                 the scores the weights come from
    c      = s + bias                                    selection only (DeepSeek-V3 noaux_tc)
    group  = sum of the top 2 of c in each of n_group equal groups (or the max: DeepSeek-V2)
    c      = -inf outside the topk_group best groups     (-inf, not 0: biased c can be < 0)
    ids    = top_k of c;  w = s[ids]
    w      = w / (sum(w) + 1e-20) if renormalize;  w *= scaling

One program per token holds the E scores in registers; groups and the top-k are k rounds of
max + argmax (E is a few hundred), replacing a dozen small torch launches per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import jit, next_power_of_2, tl


@dataclass(frozen=True)
class RoutingRule:
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    softmax: bool = False  # False: sigmoid scores
    group_max: bool = False  # group score = max (DeepSeek-V2) instead of the top-2 sum
    renormalize: bool = True
    scaling: float = 1.0


@jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_l, scaling,
    TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MAX: tl.constexpr,
    RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    logit = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        s = tl.exp(logit - tl.max(logit, 0))
        s = s / tl.sum(s, 0)
    else:
        s = tl.where(ok, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    c = tl.where(ok, c, float("-inf"))
    if N_GROUP > 1:
        group_of = e // group_size
        g = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for i in tl.static_range(N_GROUP):
            cg = tl.where(group_of == i, c, float("-inf"))
            best = tl.max(cg, 0)
            if not GROUP_MAX:
                second = tl.max(tl.where(e == tl.argmax(cg, 0), float("-inf"), cg), 0)
                best = best + second
            group_score = tl.where(g == i, best, group_score)
        kept = e < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, 0)
            kept = kept | (group_of == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        c = tl.where(kept, c, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    w_out = tl.zeros([BLOCK_K], tl.float32)
    id_out = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(c, 0)
        w_out = tl.where(kk == i, tl.sum(tl.where(e == j, s, 0.0), 0), w_out)
        id_out = tl.where(kk == i, j, id_out)
        c = tl.where(e == j, float("-inf"), c)
    if RENORM:
        w_out = w_out / (tl.sum(w_out, 0) + 1e-20)
    w_out = w_out * scaling
    tl.store(weights_ptr + t * TOP_K + kk, w_out, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, id_out, mask=kk < TOP_K)


def _check_rule(num_experts: int, rule: RoutingRule) -> None:
    assert num_experts % rule.n_group == 0, "experts split evenly into groups"
    assert rule.topk_group <= rule.n_group
    assert rule.top_k <= rule.topk_group * num_experts // rule.n_group, "top_k fits the groups"


def grouped_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, rule: RoutingRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int32 [T, top_k]) for router logits [T, E]."""
    num_tokens, num_experts = logits.shape
    _check_rule(num_experts, rule)
    assert logits.stride(1) == 1
    weights = torch.empty(num_tokens, rule.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, rule.top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _grouped_topk_kernel[(num_tokens,)](
            logits, bias if bias is not None else logits, weights, ids, num_experts,
            num_experts // rule.n_group, logits.stride(0), rule.scaling,
            TOP_K=rule.top_k, N_GROUP=rule.n_group, TOPK_GROUP=rule.topk_group,
            SOFTMAX=rule.softmax, HAS_BIAS=bias is not None, GROUP_MAX=rule.group_max,
            RENORM=rule.renormalize, BLOCK_E=next_power_of_2(num_experts),
            BLOCK_G=next_power_of_2(rule.n_group), BLOCK_K=next_power_of_2(rule.top_k),
        )  # fmt: skip
    return weights, ids


def grouped_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor | None, rule: RoutingRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of `grouped_topk` (the CPU path)."""
    num_tokens, num_experts = logits.shape
    _check_rule(num_experts, rule)
    logits = logits.float()
    scores = logits.softmax(-1) if rule.softmax else logits.sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if rule.n_group > 1:
        grouped = choice.view(num_tokens, rule.n_group, -1)  # [T, G, E / G]
        if rule.group_max:
            group_score = grouped.max(-1).values
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(rule.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, -1)
    ids = choice.topk(rule.top_k, dim=-1).indices  # [T, top_k]
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * rule.scaling, ids.int()
