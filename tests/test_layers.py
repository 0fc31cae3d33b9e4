"""Layers against independent references: transformers (RoPE, RMSNorm), naive torch/Python
(attention over the paged cache, slot mapping, TP shard layout), plain arithmetic (KV pool)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import LLAMA3_ROPE

from specserve.distributed import parallel_state
from specserve.layers.activation import SiluAndMul
from specserve.layers.attention import Attention
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.backends.torch_ref import TorchRefBackend
from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, ensure_rope_capacity
from specserve.worker.forward_batch import build_attention_metadata, build_positions

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3_ROPE,
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 24,
    },
}


@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rotary_matches_transformers(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    scaling, head_dim, theta = ROPE_CASES[kind], 32, 5000.0
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    ref_rope = hf.LlamaRotaryEmbedding(cfg)
    # a cache of 8 positions, then positions far past it: the cache must grow, never clamp
    ours = RotaryEmbedding(head_dim, 8, theta, scaling)
    positions = torch.tensor([0, 1, 5, 7, 8, 63, 64, 200, 1000, 3])
    ours.ensure_capacity(int(positions.max()) + 1)
    q, k = torch.randn(10, 4, head_dim), torch.randn(10, 2, head_dim)
    got_q, got_k = ours(positions, q, k)
    cos, sin = ref_rope(q, positions[None])  # [1, T, head_dim]
    ref_q, ref_k = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotary_grows_inside_a_forward_and_for_graphs() -> None:
    big = RotaryEmbedding(16, 512, 10000.0)
    small = RotaryEmbedding(16, 8, 10000.0)
    positions = torch.tensor([299, 0, 150])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    md = build_attention_metadata([3], [300], [list(range(75))], 4, "cpu")
    set_forward_context(ForwardContext(md, TorchRefBackend()))
    try:
        got = small(positions, q, k)
    finally:
        set_forward_context(None)
    for g, e in zip(got, big(positions, q, k)):
        torch.testing.assert_close(g, e)
    holder = torch.nn.ModuleList([RotaryEmbedding(16, 8, 10000.0)])
    ensure_rope_capacity(holder, 1000)
    assert holder[0].cos_sin_cache.shape[0] >= 1000


def test_rotary_unsupported_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="dynamic.*default, linear, llama3, yarn"):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_rmsnorm_matches_transformers_with_fused_residual() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5)
    weight = torch.randn(48)
    ref.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x, res = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype)
        ref.to(dtype)
        ours.to(dtype)
        torch.testing.assert_close(ours(x), ref(x), atol=tol, rtol=tol)
        normed, summed = ours(x, res)
        torch.testing.assert_close(summed, x + res)
        torch.testing.assert_close(normed, ref(x + res), atol=tol, rtol=tol)


def test_silu_and_mul() -> None:
    x = torch.randn(6, 20)
    expected = x[:, :10] * torch.sigmoid(x[:, :10]) * x[:, 10:]
    torch.testing.assert_close(SiluAndMul()(x), expected)


def test_qkv_and_merged_linear_at_tp1() -> None:
    hidden, hd, heads, kv = 32, 8, 4, 2
    wq, wk, wv = (
        torch.randn(heads * hd, hidden),
        torch.randn(kv * hd, hidden),
        torch.randn(kv * hd, hidden),
    )
    bq, bk, bv = torch.randn(heads * hd), torch.randn(kv * hd), torch.randn(kv * hd)
    qkv = QKVParallelLinear(hidden, hd, heads, kv, bias=True)
    for shard, w, b in (("k", wk, bk), ("q", wq, bq), ("v", wv, bv)):  # any order
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, b, shard)
    x = torch.randn(3, hidden)
    expected = torch.cat([F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)], -1)
    torch.testing.assert_close(qkv(x), expected)

    gate, up = torch.randn(24, hidden), torch.randn(24, hidden)
    merged = MergedColumnParallelLinear(hidden, [24, 24])
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], -1))
    with pytest.raises(ValueError, match=r"\(24, 31\)"):
        merged.weight.weight_loader(merged.weight, torch.randn(24, 31), 0)


def _shard_rows(monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)


def test_tp_shard_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each rank holds, checked against slices written out by hand (no collectives)."""
    hidden, hd, heads, kv, tp = 16, 4, 4, 2, 2
    wq, wk, wv = torch.randn(16, hidden), torch.randn(8, hidden), torch.randn(8, hidden)
    w_row = torch.randn(hidden, 12)
    table = torch.randn(7, hidden)  # vocab 7 over 2 ranks: shard 4, rank 1 has a pad row
    for rank in range(tp):
        _shard_rows(monkeypatch, rank, tp)
        qkv = QKVParallelLinear(hidden, hd, heads, kv)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight.weight_loader(qkv.weight, w, shard)
        # rank r: q heads [2r, 2r+2), kv head r
        expected = torch.cat(
            [wq[8 * rank : 8 * rank + 8], wk[4 * rank : 4 * rank + 4], wv[4 * rank : 4 * rank + 4]]
        )
        torch.testing.assert_close(qkv.weight.data, expected)
        row = RowParallelLinear(12, hidden)
        row.weight.weight_loader(row.weight, w_row)
        torch.testing.assert_close(row.weight.data, w_row[:, 6 * rank : 6 * rank + 6])
        col = ColumnParallelLinear(hidden, 8)
        col.weight.weight_loader(col.weight, wk)
        torch.testing.assert_close(col.weight.data, wk[4 * rank : 4 * rank + 4])
        emb = VocabParallelEmbedding(7, hidden)
        emb.weight.weight_loader(emb.weight, table)
        expected = table[:4] if rank == 0 else torch.cat([table[4:], torch.zeros(1, hidden)])
        torch.testing.assert_close(emb.weight.data, expected)


def test_tp_rejects_indivisible_kv_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    _shard_rows(monkeypatch, 0, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\).*tp_size \(4\)"):
        QKVParallelLinear(32, 8, 8, 2)


def test_embedding_and_lm_head_at_tp1() -> None:
    table = torch.randn(11, 8)
    emb, head = VocabParallelEmbedding(11, 8), ParallelLMHead(11, 8)
    emb.weight.weight_loader(emb.weight, table)
    head.weight.weight_loader(head.weight, table)
    ids = torch.tensor([0, 10, 3, 3])
    torch.testing.assert_close(emb(ids), table[ids])
    h = torch.randn(2, 8)
    torch.testing.assert_close(head.compute_logits(h), h @ table.T)
    with pytest.raises(ValueError, match=r"\(12, 8\)"):
        emb.weight.weight_loader(emb.weight, torch.randn(12, 8))


def _naive_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix: int,
    tree: list[list[bool]] | None,
    scale: float,
) -> torch.Tensor:
    """Plain loops: query i of a request with `prefix` cached tokens; tree[i][j] (or causal)."""
    q_len, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty_like(q)
    for i in range(q_len):
        visible = list(range(prefix)) + [
            prefix + j for j in range(q_len) if (tree[i][j] if tree is not None else j <= i)
        ]
        for h in range(heads):
            scores = [float(q[i, h] @ keys[j, h // group]) * scale for j in visible]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, h] = sum(w / total * values[j, h // group] for w, j in zip(weights, visible))
    return out


@pytest.mark.parametrize("use_tree", [False, True])
def test_torch_ref_backend_vs_naive(use_tree: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv, hd, ps, pages = 4, 2, 8, 4, 16
    cached, new = [5, 0, 9, 3], [3, 6, 1, 4]  # extend, prefill, decode, extend
    seq_lens = [c + n for c, n in zip(cached, new)]
    order = torch.randperm(pages, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        need = -(-s // ps)
        tables.append(order[:need])
        order = order[need:]
    # poisoned cache: any read outside a request's valid slots turns the output into NaN
    k_cache = torch.full((pages, ps, kv, hd), float("nan"))
    v_cache = torch.full((pages, ps, kv, hd), float("nan"))
    full_k = [torch.randn(s, kv, hd, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, kv, hd, generator=gen) for s in seq_lens]
    for r, c in enumerate(cached):  # the cached prefix, written by hand
        for p in range(c):
            page, off = tables[r][p // ps], p % ps
            k_cache[page, off], v_cache[page, off] = full_k[r][p], full_v[r][p]
    max_q = max(new)
    trees = None
    mask = None
    if use_tree:  # random ancestor sets; each node sees itself
        tree_masks = torch.rand(len(new), max_q, max_q, generator=gen) < 0.5
        tree_masks |= torch.eye(max_q, dtype=torch.bool)
        trees = [
            [[bool(tree_masks[r, i, j]) for j in range(n)] for i in range(n)]
            for r, n in enumerate(new)
        ]
        # width W = max_q covers the last W KV entries: a request with fewer new tokens sees
        # its leading columns as prefix (all visible), its new tokens in the last n columns
        mask = torch.ones(len(new), max_q, max_q, dtype=torch.bool)
        for r, n in enumerate(new):
            mask[r, :n, max_q - n :] = tree_masks[r, :n, :n]
    md = build_attention_metadata(new, seq_lens, tables, ps, "cpu", custom_mask=mask)
    q = torch.randn(sum(new), heads, hd, generator=gen)
    k = torch.cat([full_k[r][c:] for r, c in enumerate(cached)])
    v = torch.cat([full_v[r][c:] for r, c in enumerate(cached)])
    out = TorchRefBackend().forward(q, k, v, k_cache, v_cache, md, scale=hd**-0.5)
    start = 0
    for r, (c, n) in enumerate(zip(cached, new)):
        tree = trees[r] if trees else None
        ref = _naive_attention(q[start : start + n], full_k[r], full_v[r], c, tree, hd**-0.5)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        for p in range(seq_lens[r]):  # the new K/V landed in their slots
            torch.testing.assert_close(k_cache[tables[r][p // ps], p % ps], full_k[r][p])
        start += n


def test_backend_skips_negative_slots_and_attention_module() -> None:
    ps, kv, hd = 2, 1, 4
    k_cache, v_cache = torch.randn(3, ps, kv, hd), torch.randn(3, ps, kv, hd)
    before = k_cache.clone()
    md = build_attention_metadata([2], [2], [[1]], ps, "cpu")
    md.slot_mapping[1] = -1  # a padded token: its K/V must not be written
    attn = Attention(2, kv, hd, 0.5, layer_idx=0)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    set_forward_context(ForwardContext(md, TorchRefBackend()))
    k = torch.randn(2, kv * hd)
    attn(torch.randn(2, 2 * hd), k, torch.randn(2, kv * hd))
    set_forward_context(None)
    torch.testing.assert_close(k_cache[1, 0], k[0].view(kv, hd))
    torch.testing.assert_close(k_cache[1, 1], before[1, 1])
    torch.testing.assert_close(k_cache[[0, 2]], before[[0, 2]])


def test_build_attention_metadata_vs_naive() -> None:
    ps = 4
    q_lens, seq_lens = [3, 1, 6], [8, 10, 6]
    tables = [[7, 2], [0, 5, 9], [4, 1]]
    md = build_attention_metadata(q_lens, seq_lens, tables, ps, "cpu")
    expected_slots = []
    for q_len, s, pages in zip(q_lens, seq_lens, tables):
        every = [p * ps + o for p in pages for o in range(ps)]  # slot of each position
        expected_slots += every[s - q_len : s]
    assert md.slot_mapping.tolist() == expected_slots
    assert md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.tolist() == [0, 3, 4, 10]
    assert md.seq_lens.tolist() == seq_lens
    assert md.page_table.tolist() == [[7, 2, -1], [0, 5, 9], [4, 1, -1]]
    assert (md.max_query_len, md.max_seq_len) == (6, 10)
    assert md.query_lens_cpu == q_lens and md.seq_lens_cpu == seq_lens
    assert build_positions(q_lens, seq_lens, "cpu").tolist() == [5, 6, 7, 9, 0, 1, 2, 3, 4, 5]
