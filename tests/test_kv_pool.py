"""KV-cache specs and the pool laid out by them, against plain arithmetic: page bytes per
attention kind, pool sizing, layer groups (llama target + draft in one group; an MLA target
with an MHA draft layer in two), binding checks, and compaction through the groups."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig
from specserve.kernels.kv_compact import compact_kv_ref
from specserve.kv_cache.pool import KVPool, bytes_per_page, pages_for_budget, plan_num_pages
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention import Attention, CachedAttention

MHA = KVCacheSpec.mha(2, 64)
MLA = KVCacheSpec.mla(512, 64)  # DeepSeek-V3 / Kimi K2 dims


class LatentLayer(CachedAttention):
    """A stand-in MLA layer: declares the latent spec, as layers/mla.py's module does."""

    def __init__(self, layer_idx: int, rank: int = 16, rope: int = 8) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.rank, self.rope = rank, rope
        self.latent_cache = torch.empty(0)

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec.mla(self.rank, self.rope)


def test_spec_sizes() -> None:
    assert MHA.elements_per_token == 2 * 2 * 64 and MHA.names == ("k", "v")
    assert KVCacheSpec.mha(8, 128, 64).elements_per_token == 8 * (128 + 64)
    assert MLA.elements_per_token == 576 and MLA.names == ("latent",)
    assert MLA.bytes_per_page(64, 2) == 64 * 1152  # 1152 B per token and layer in bf16
    assert "latent [576]" in MLA.describe() and "k [2, 64]" in MHA.describe()
    assert KVCacheSpec.mla(512, 64) == MLA != MHA  # specs compare by value (pool groups)


def test_pool_sizing_over_specs() -> None:
    specs = [MLA] * 3 + [MHA]
    per_page = bytes_per_page(specs, 16, torch.bfloat16)
    assert per_page == 16 * 2 * (3 * 576 + 2 * 2 * 64)
    assert bytes_per_page([MHA] * 3, 16, torch.float32) == 2 * 3 * 16 * 2 * 64 * 4
    assert pages_for_budget(10 * per_page + 7, specs, 16, torch.bfloat16) == 10
    assert pages_for_budget(per_page - 1, specs, 16, torch.bfloat16) == 0
    cpu = torch.device("cpu")
    budget = CacheConfig(page_size=16, kv_cache_bytes=10 * per_page + 7)
    assert plan_num_pages(budget, specs, torch.bfloat16, cpu) == 10
    assert plan_num_pages(CacheConfig(num_pages=7), specs, torch.bfloat16, cpu) == 7
    with pytest.raises(ValueError, match="raise --kv-cache-bytes"):
        plan_num_pages(
            CacheConfig(page_size=16, kv_cache_bytes=per_page), specs, torch.bfloat16, cpu
        )


def test_gpu_budget_leaves_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the pool gets gpu_memory_utilization of the free memory less a fixed reserve
    and the bytes of weights built after it (the drafters')."""
    from specserve.kv_cache import pool

    per_page = bytes_per_page([MHA], 16, torch.bfloat16)
    free = pool.GPU_RESERVE_BYTES + 1000 * per_page
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    cache, gpu = CacheConfig(page_size=16, gpu_memory_utilization=1.0), torch.device("cuda")
    assert plan_num_pages(cache, [MHA], torch.bfloat16, gpu) == 1000
    assert plan_num_pages(cache, [MHA], torch.bfloat16, gpu, 300 * per_page + 1) == 699
    with pytest.raises(ValueError, match="pages"):
        plan_num_pages(cache, [MHA], torch.bfloat16, gpu, 999 * per_page)


def test_llama_pool_is_one_group() -> None:
    """A llama target and its draft layer: one group, k and v of all layers (the layout the
    kernels and the compaction have always seen)."""
    pool = KVPool([KVCacheSpec.mha(2, 8)] * 3, 5, 4, torch.float16, "cpu")
    assert len(pool.groups) == 1 and pool.groups[0].num_layers == 3
    k, v = pool.groups[0].tensors["k"], pool.groups[0].tensors["v"]
    assert k.shape == v.shape == (3, 5, 4, 2, 8)
    assert pool.total_bytes == 5 * bytes_per_page(pool.specs, 4, torch.float16)
    target = [Attention(4, 2, 8, 1.0, i) for i in range(2)]
    draft = Attention(4, 2, 8, 1.0, 0)
    pool.bind(target)
    pool.bind([draft], first_layer=2)
    for layer, module in enumerate([*target, draft]):
        assert module.k_cache.shape == (5, 4, 2, 8)
        module.k_cache[1, 2].fill_(layer + 1)
        module.v_cache[3, 0].fill_(-layer - 1)
        assert (k[layer, 1, 2] == layer + 1).all() and (v[layer, 3, 0] == -layer - 1).all()
    with pytest.raises(ValueError, match="pool has 3"):
        pool.bind(target, first_layer=2)
    with pytest.raises(ValueError, match=r"k \[4, 8\].*sized for mha k \[2, 8\]"):
        pool.bind([Attention(4, 4, 8, 1.0, 0)])
    assert pool.groups_below(2) == [(pool.groups[0], 2)]


def test_mla_target_with_mha_draft() -> None:
    """Latent pages for the MLA target layers, k + v for the draft layer after them; a module
    of the wrong kind is refused; compaction over the target layers touches only the latent."""
    target = [LatentLayer(i) for i in range(3)]
    draft = Attention(4, 2, 8, 1.0, 0)
    specs = [m.kv_spec for m in target] + [draft.kv_spec]
    pool = KVPool(specs, 6, 4, torch.float32, "cpu")
    assert [(g.spec.kind, g.first_layer, g.num_layers) for g in pool.groups] == [
        ("mla", 0, 3),
        ("mha", 3, 1),
    ]
    latent = pool.groups[0].tensors["latent"]
    assert latent.shape == (3, 6, 4, 24)
    assert pool.total_bytes == 4 * 6 * 4 * (3 * 24 + 2 * 2 * 8)
    pool.bind(target)
    pool.bind([draft], first_layer=3)
    assert target[1].latent_cache.shape == (6, 4, 24)
    assert target[1].latent_cache.data_ptr() == latent[1].data_ptr()
    assert draft.k_cache.shape == (6, 4, 2, 8)
    with pytest.raises(ValueError, match="keeps mha.*sized for mla latent"):
        pool.bind([draft])
    with pytest.raises(ValueError, match="keeps mla.*sized for mha"):
        pool.bind([LatentLayer(0)], first_layer=3)
    gen = torch.Generator().manual_seed(0)
    for g in pool.groups:
        for t in g.tensors.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    before = {n: t.clone() for g in pool.groups for n, t in g.tensors.items()}
    src, dst = torch.tensor([[9, 13, 2]]), torch.tensor([[9, 10, 11]])
    groups = pool.groups_below(3)
    assert groups == [(pool.groups[0], 3)]
    for group, num in groups:
        compact_kv_ref(list(group.tensors.values()), num, src, dst)
    flat, old = latent.flatten(1, 2), before["latent"].flatten(1, 2)
    assert torch.equal(flat[:, 10], old[:, 13]) and torch.equal(flat[:, 11], old[:, 2])
    assert torch.equal(flat[:, 9], old[:, 9])
    for name in ("k", "v"):  # the draft layer is never compacted
        assert torch.equal(pool.groups[1].tensors[name], before[name])


def test_kv_budget_leaves_room_for_sampling_the_widest_verify() -> None:
    """A tree's sampled verify graph at the largest batch bucket sorts bucket x nodes rows of
    the vocabulary: the KV pool's budget leaves that room (an OOM at capture on an 80 GB card
    with a 16-node tree at batch 128 before)."""
    from specserve import defaults
    from specserve.llm import LLM

    pair = defaults.tiny_code_path()
    tree = dict(algorithm="eagle3", draft_model=defaults.tiny_code_draft_path(), num_steps=3,
                topk=4, num_draft_tokens=16)
    llm = LLM(pair, device="cpu", dtype="float32", speculative_config=tree,
              scheduler=dict(max_num_seqs=32))
    rows = 32 * 16  # min(cuda_graph_max_bs, max_num_seqs) x nodes
    logits = torch.empty(rows, llm.engine.model_config.vocab_size)
    values, order = logits.sort(dim=-1)
    workspace = sum(t.numel() * t.element_size() for t in (logits, values, order, logits))
    assert llm.engine.runner.reserve_bytes >= workspace
