"""The DeepSeek MoE block vs transformers' DeepseekV3MoE / DeepseekV2Moe (fp32, tiny random
configs), TP=2 (gloo) vs TP=1, the config adapter's spellings and the dense-or-MoE choice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from specserve.config import MoEConfig
from specserve.distributed import parallel_state
from specserve.layers.mlp import GatedMLP
from specserve.layers.moe import DeepseekMoE, expert_shards, make_mlp
from specserve.models.weights import load_named_weights

HIDDEN, INTER, TOL = 64, 32, 1e-5


def _moe(experts: int, top_k: int, groups: int, kept: int, shared: int, **kw: object) -> dict:
    return dict(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups,
                topk_group=kept, n_shared_experts=shared, **kw)  # fmt: skip


# name -> (transformers family, config overrides)
CASES = {
    # Kimi K2 routing: one group, top 4 of 16, one shared expert
    "v3_one_group": ("v3", _moe(16, 4, 1, 1, 1)),
    # DeepSeek-V3 routing: 4 groups of 4, the best 2 kept, top 3
    "v3_groups": ("v3", _moe(16, 3, 4, 2, 1)),
    "v3_top1_no_norm": ("v3", _moe(8, 1, 4, 1, 2, norm_topk_prob=False)),
    # every expert of the kept groups chosen: a kept expert whose biased score is negative must
    # still beat the masked ones (-inf masking, not 0)
    "v3_all_kept": ("v3", _moe(8, 4, 4, 2, 1)),
    "v3_top8_no_shared": ("v3", _moe(16, 8, 2, 2, 0)),
    "v2_greedy": ("v2", _moe(8, 2, 1, 1, 2, topk_method="greedy", routed_scaling_factor=16.0)),
    "v2_group_limited": ("v2", _moe(12, 3, 3, 2, 1, topk_method="group_limited_greedy")),
}


def hf_moe(family: str, seed: int = 0, **overrides: object) -> tuple[torch.nn.Module, dict]:
    """A transformers MoE block with random weights and a random correction bias (negative
    entries included) in fp32; and its config as saved by transformers."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    kwargs: dict = dict(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        routed_scaling_factor=2.827,
    )
    if family == "v3":
        kwargs["norm_topk_prob"] = True
    kwargs.update(overrides)
    config_cls, block_cls = {
        "v3": (tf.DeepseekV3Config, DeepseekV3MoE), "v2": (tf.DeepseekV2Config, DeepseekV2Moe)
    }[family]  # fmt: skip
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    block = block_cls(config).float().eval()
    if not config.n_shared_experts:
        block.shared_experts = None  # transformers builds an MLP of size 0; drop it
        block.forward = _routed_only(block)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in block.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))  # shifts the selection
            elif name == "gate.weight":
                t.copy_(torch.randn(t.shape, generator=gen) / HIDDEN**0.25)  # decisive routing
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
    return block, config.to_dict()


def _routed_only(block: torch.nn.Module):  # noqa: ANN202
    def forward(x: torch.Tensor) -> torch.Tensor:
        _, weights, ids = block.gate(x)
        return block.experts(x.view(-1, x.shape[-1]), ids, weights).view(x.shape)

    return forward


def per_expert_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked in-memory expert tensors -> the per-expert checkpoint names."""
    out = {}
    for name, t in state.items():
        if name == "experts.gate_up_proj":
            for e, w in enumerate(t):
                out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = w.chunk(
                    2
                )
        elif name == "experts.down_proj":
            out.update({f"experts.{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            out[name] = t
    return out


SHARED = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


def load_block(block: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Checkpoint-named tensors into our block (every parameter must be covered)."""
    load_named_weights(block, state.items(), SHARED, "DeepseekMoE")


def ours(config: dict, state: dict[str, torch.Tensor]) -> DeepseekMoE:
    moe = MoEConfig.from_hf(config)
    assert moe is not None
    block = DeepseekMoE(HIDDEN, moe)
    load_block(block, state)
    return block.eval()


def inputs(seed: int = 1, num_tokens: int = 37) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, dict]:
    family, overrides = CASES[request.param]
    block, config = hf_moe(family, **overrides)
    return request.param, block, config


def test_block_matches_transformers(case: tuple[str, torch.nn.Module, dict]) -> None:
    name, hf, config = case
    x = inputs()
    with torch.no_grad():
        want = hf(x[None])[0]
        for state in (hf.state_dict(), per_expert_names(hf.state_dict())):
            got = ours(config, state)(x)
            err = (got - want).abs().max().item()
            assert err < TOL * want.abs().max().item(), f"{name}: max abs diff {err}"


def test_routing_matches_transformers(case: tuple[str, torch.nn.Module, dict]) -> None:
    """The same experts and weights per token; and the test data makes the rules matter."""
    name, hf, config = case
    x = inputs(2, 200)
    block = ours(config, hf.state_dict())
    with torch.no_grad():
        _, want_w, want_ids = hf.gate(x)
        got_w, got_ids = block.gate(x)
        want_ids, order = want_ids.sort(1)
        got_ids, got_order = got_ids.long().sort(1)
        assert torch.equal(got_ids, want_ids), name
        assert (got_w.gather(1, got_order) - want_w.gather(1, order)).abs().max() < 1e-6
        bias = getattr(hf.gate, "e_score_correction_bias", None)
        if bias is not None:  # selection with the bias zeroed must differ somewhere
            saved = bias.clone()
            bias.zero_()
            unbiased = hf.gate(x)[2].sort(1).values
            bias.copy_(saved)
            assert not torch.equal(unbiased, want_ids), f"{name}: the bias changed nothing"
        if block.gate.rule.n_group > 1 and block.gate.rule.topk_group < block.gate.rule.n_group:
            plain = torch.sigmoid(x @ block.gate.weight.T) + (bias if bias is not None else 0)
            top = plain.topk(block.gate.rule.top_k, dim=-1).indices.sort(1).values
            assert not torch.equal(top, want_ids), f"{name}: the group mask changed nothing"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_cuda_matches_transformers(
    case: tuple[str, torch.nn.Module, dict], dtype: torch.dtype
) -> None:
    """The Triton path (routing kernel, fused MoE) against transformers on the same rounded
    inputs: bf16 experts and activations, the router in fp32 in both."""
    import copy

    name, hf, config = case
    x = inputs(4, 300).to(dtype)
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if not pname.startswith("gate."):
                p.copy_(p.to(dtype).float())
        want = ref(x.float()[None])[0]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            block = DeepseekMoE(HIDDEN, MoEConfig.from_hf(config))
    finally:
        torch.set_default_dtype(previous)
    assert block.gate.weight.dtype == torch.float32
    load_block(block, hf.state_dict())
    with torch.no_grad():
        got = block(x.cuda()).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got - want).abs().max().item()
    assert err < tol * want.abs().max().item(), f"{name} {dtype}: max abs diff {err}"


def test_expert_loader_errors() -> None:
    block, config = hf_moe("v3", n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                           topk_group=1)  # fmt: skip
    state = per_expert_names(block.state_dict())
    state["experts.3.up_proj.weight"] = state["experts.3.up_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="shape mismatch"):
        ours(config, state)
    moe_block = DeepseekMoE(HIDDEN, MoEConfig.from_hf(config))
    w13 = moe_block.experts.w13_weight
    with pytest.raises(ValueError, match="shard_id"):
        w13.weight_loader(w13, torch.zeros(INTER, HIDDEN), (8, "gate"))
    with pytest.raises(ValueError, match="does not belong"):
        w13.weight_loader(w13, torch.zeros(HIDDEN, INTER), (0, "down"))
    assert expert_shards("model.layers.3.mlp.shared_experts.gate_proj.weight", w13) is None
    assert len(w13.shard_ids) == 16
    state = per_expert_names(block.state_dict())
    del state["experts.5.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: experts\.5\.down_proj\.weight$"):
        ours(config, state)


# --------------------------------------------------------------------------------------------
# TP=2 on the CPU: two gloo processes give the output of one

TP = 2


def _tp_worker(rank: int, path: str, port: int) -> None:
    torch.set_num_threads(1)
    parallel_state.init_distributed(TP, rank, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        saved = torch.load(path, weights_only=True)
        outs = {}
        for name, (config, state) in saved["cases"].items():
            block = DeepseekMoE(HIDDEN, MoEConfig(**config))
            assert block.experts.w13_weight.shape[1] == INTER  # 2 * I / tp rows
            load_block(block, state)
            with torch.no_grad():
                outs[name] = block(saved["x"])
        torch.save(outs, path.replace(".pt", f".rank{rank}.pt"))
    finally:
        parallel_state.destroy()


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    cases, want = {}, {}
    x = inputs(3, 29)
    for name in ("v3_groups", "v3_top1_no_norm"):
        hf, config = hf_moe(CASES[name][0], **CASES[name][1])
        moe = MoEConfig.from_hf(config)
        state = per_expert_names(hf.state_dict())
        cases[name] = (moe.__dict__, state)
        with torch.no_grad():
            want[name] = ours(config, state)(x)
    path = str(tmp_path / "moe.pt")
    torch.save({"cases": cases, "x": x}, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(path, port), nprocs=TP, join=True)
    for rank in range(TP):
        got = torch.load(path.replace(".pt", f".rank{rank}.pt"), weights_only=True)
        for name, out in want.items():
            err = (got[name] - out).abs().max().item()
            assert err < 1e-5, f"{name} rank {rank}: max abs diff {err}"


# --------------------------------------------------------------------------------------------
# config adapter and layer kinds

KIMI_K2_HUB = {  # the MoE fields of Kimi K2's config.json (hub spelling)
    "n_routed_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 18432,
}  # fmt: skip


def test_config_spellings() -> None:
    import transformers as tf

    kimi = MoEConfig.from_hf(KIMI_K2_HUB)
    assert (kimi.num_experts, kimi.num_experts_per_tok, kimi.intermediate_size) == (384, 8, 2048)
    assert kimi.routed_scaling_factor == 2.827 and kimi.has_correction_bias
    saved = tf.DeepseekV3Config(
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
    ).to_dict()
    assert MoEConfig.from_hf(saved) == kimi
    v2 = MoEConfig.from_hf(tf.DeepseekV2Config(topk_method="greedy").to_dict())  # n_group null
    assert (v2.n_group, v2.scoring_func, v2.norm_topk_prob, v2.has_correction_bias) == (
        1, "softmax", False, False)  # fmt: skip
    other = dict(KIMI_K2_HUB)
    other["num_local_experts"] = other.pop("n_routed_experts")
    assert MoEConfig.from_hf(other) == kimi
    lite = MoEConfig.from_hf(tf.Glm4MoeLiteConfig(num_hidden_layers=4).to_dict())
    assert [lite.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert MoEConfig.from_hf({"hidden_size": 64, "intermediate_size": 128}) is None
    for bad, match in (({"n_group": 5}, "divide"), ({"scoring_func": "relu"}, "scoring_func"),
                       ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
                       ({"n_group": 384, "topk_group": 8}, "top 2")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            MoEConfig.from_hf({**KIMI_K2_HUB, **bad})


def test_layer_kinds() -> None:
    moe = MoEConfig(8, 2, 16, num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=2)
    kinds = [type(make_mlp(i, 32, 48, moe)) for i in range(5)]
    assert kinds == [GatedMLP, GatedMLP, DeepseekMoE, GatedMLP, DeepseekMoE]
    dense = make_mlp(0, 32, 48, moe)
    assert dense.down_proj.weight.shape == (32, 48)  # the dense intermediate size
    assert type(make_mlp(3, 32, 48, None)) is GatedMLP
