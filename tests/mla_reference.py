"""The MLA layer (layers/mla.py) next to transformers' DeepseekV3Attention holding the same
random weights, fp32, tiny configs: q_lora_rank set and None, interleaved and rotate-half rope,
default and yarn rope (mscale != mscale_all_dim), biases. Drivers check the layer over a paged
cache against transformers at every position: a schedule of batched prefill, random chunked
extends or decode steps (CASES), and a tree-masked verify. Used by test_mla.py,
test_mla_gpu.py and test_mla_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch
from engine_drivers import PagedSession
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.mla import MLAAttention

hf_ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config  # noqa: E402

YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
CONFIGS = {
    # Kimi-flavoured: q_lora, yarn with beta 1/1, interleaved rope
    "yarn_interleaved": {"q_lora_rank": 32, "rope_parameters": YARN},
    # DeepSeek-V2-Lite-flavoured: one q_proj, plain rope, rotate-half, biases
    "qproj_neox_bias": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # mscale != mscale_all_dim: cos/sin scaled by their ratio, softmax by mscale_all_dim^2
    "yarn_mscale": {
        "q_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "v_head_dim": 24,
        "rope_parameters": {
            **YARN,
            "factor": 8.0,
            "beta_fast": 32.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.3,
        },
    },
}
FORMS = ("compute", "absorbed", "auto")


def hf_config(name: str) -> DeepseekV3Config:
    kw = {
        "vocab_size": 64,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "num_mtp_layers": 0,
        "max_position_embeddings": 256,
        **CONFIGS[name],
    }
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


class Pair:
    """One HF DeepseekV3Attention with random weights and our layer holding the same ones."""

    def __init__(self, name: str, form: str, device: str = "cpu", seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg = hf_config(name)
        self.hf = hf_ds.DeepseekV3Attention(self.cfg, 0).to(device)
        self.rope = hf_ds.DeepseekV3RotaryEmbedding(self.cfg).to(device)
        with torch.no_grad():
            for pname, p in self.hf.named_parameters():
                if "layernorm" in pname:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(0.3 * torch.randn_like(p) / p.shape[-1] ** 0.25)
        self.config = ModelConfig.from_hf(self.cfg.to_dict())
        with torch.device(device):
            self.ours = MLAAttention(self.config, 0, form=form)
        load(self.ours, self.hf)

    def reference(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HF over one whole sequence x [S, H] (causal unless `mask` [S, S] bool)."""
        s = x.shape[0]
        if positions is None:
            positions = torch.arange(s, device=x.device)
        if mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        additive = torch.zeros(s, s, device=x.device).masked_fill(~mask, float("-inf"))
        cos_sin = self.rope(x[None], positions[None])
        with torch.no_grad():
            return self.hf(x[None], cos_sin, additive[None, None])[0][0]


def load(ours: nn.Module, hf: nn.Module) -> None:
    params = dict(ours.named_parameters())
    names = dict(hf.named_parameters())
    assert set(params) == set(names), set(params) ^ set(names)
    with torch.no_grad():
        for name, tensor in names.items():
            params[name].weight_loader(params[name], tensor)


class LayerOnly(nn.Module):
    """Token id i stands for input row i of `inputs` [n, H]; the model is the layer alone."""

    def __init__(self, attn: MLAAttention, inputs: torch.Tensor) -> None:
        super().__init__()
        self.attn = attn
        self.inputs = inputs

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.attn(positions, self.inputs[ids])


def make_inputs(lens: list[int], hidden: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen).to(device) for n in lens]


def schedule(kind: str, lens: list[int], rng: random.Random) -> list[dict[int, tuple[int, int]]]:
    """Steps of {request: (start, end)}: one batched prefill; random chunks of random subsets;
    or a short prefill then one token per step for every unfinished request."""
    if kind == "prefill":
        return [{r: (0, n) for r, n in enumerate(lens)}]
    done, steps = [0] * len(lens), []
    if kind == "decode":
        steps.append({r: (0, d) for r, n in enumerate(lens) if (d := min(n, rng.randint(1, 4)))})
        done = [min(n, steps[0].get(r, (0, 0))[1]) for r, n in enumerate(lens)]
    while any(d < n for d, n in zip(done, lens)):
        step = {}
        for r, n in enumerate(lens):
            if done[r] < n and (kind == "decode" or rng.random() < 0.7):
                size = 1 if kind == "decode" else rng.randint(1, 7)
                step[r] = (done[r], min(n, done[r] + size))
                done[r] = step[r][1]
        if step:
            steps.append(step)
    return steps


def check_schedule(
    pair: Pair,
    kind: str,
    lens: list[int],
    page_size: int,
    device: str,
    backend: object,
    tol: float = 1e-4,
    seed: int = 0,
) -> None:
    xs = make_inputs(lens, pair.cfg.hidden_size, device, seed)
    offsets = [sum(lens[:r]) for r in range(len(lens))]
    session = PagedSession(
        LayerOnly(pair.ours, torch.cat(xs)), num_pages=64, page_size=page_size, seed=seed
    )
    session.backend = backend
    got: list[list[torch.Tensor]] = [[] for _ in lens]
    for step in schedule(kind, lens, random.Random(seed)):
        ids = {r: list(range(offsets[r] + a, offsets[r] + b)) for r, (a, b) in step.items()}
        for r, out in zip(ids, session.step(ids, logits=False)):
            got[r].append(out)
    for r, x in enumerate(xs):
        want = pair.reference(x)
        err = (torch.cat(got[r]) - want).abs().max().item()
        assert err < tol, f"request {r} ({kind}): max abs diff {err:.3g}"


CASES = [
    ("prefill", [5, 1, 12, 7], 4),
    ("chunked", [9, 17, 3, 22], 4),
    ("chunked", [30, 11], 1),
    ("decode", [6, 13, 2, 9], 16),
]


def tree_verify(pair: Pair, device: str, backend: object, tol: float = 1e-4) -> None:
    """Prefix prefill, then n tree nodes in one forward with the ancestor mask (node i at slot
    P + i, position P + depth): HF over prefix + nodes with the same mask and positions."""
    rng = random.Random(3)
    prefixes, n = [7, 12, 3], 6
    session = PagedSession(LayerOnly(pair.ours, torch.empty(0)), page_size=4)
    session.backend = backend
    ancestors = torch.zeros(len(prefixes), n, n, dtype=torch.bool)
    depth = torch.zeros(len(prefixes), n, dtype=torch.long)
    for r in range(len(prefixes)):
        ancestors[r, 0, 0] = True
        for i in range(1, n):
            parent = rng.randrange(i)
            ancestors[r, i] = ancestors[r, parent]
            ancestors[r, i, i] = True
            depth[r, i] = depth[r, parent] + 1
    xs = make_inputs([p + n for p in prefixes], pair.cfg.hidden_size, device, 5)
    session.model.inputs = torch.cat(
        [x[:p] for x, p in zip(xs, prefixes)] + [x[p:] for x, p in zip(xs, prefixes)]
    )
    base = sum(prefixes)
    session.step(
        {r: list(range(sum(prefixes[:r]), sum(prefixes[: r + 1]))) for r in range(len(prefixes))},
        logits=False,
    )
    ids = {r: list(range(base + r * n, base + (r + 1) * n)) for r in range(len(prefixes))}
    positions = torch.cat([p + depth[r] for r, p in enumerate(prefixes)])
    outs = session.step(ids, logits=False, custom_mask=ancestors, positions=positions)
    for r, (x, p) in enumerate(zip(xs, prefixes)):
        mask = torch.ones(p + n, p + n, dtype=torch.bool).tril()
        mask[p:, p:] = ancestors[r]
        pos = torch.cat([torch.arange(p), p + depth[r]])
        want = pair.reference(x, pos.to(device), mask.to(device))[p:]
        err = (outs[r] - want).abs().max().item()
        assert err < tol, f"request {r}: max abs diff {err:.3g}"
