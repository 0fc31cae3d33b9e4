"""The MLA layer (layers/mla.py) against transformers' DeepseekV3Attention, fp32, tiny random
configs built here: batched prefill, chunked extend over a paged cache (shuffled pages),
decode, and a tree-masked verify, at every position (< 1e-4), in the compute form, the
absorbed form and the per-forward choice; q_lora_rank set and None, interleaved and rotate-half
rope, default and yarn rope (mscale != mscale_all_dim: the cos/sin factor and the softmax
correction both matter), biases, page sizes 1/4/16, no pool bound. TP over heads: two ranks'
partial outputs sum to the TP=1 output. The torch backend runs on the CPU; the same checks
run the Triton backend on CUDA (marker `gpu`)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from engine_drivers import PagedSession
from torch import nn

from specserve.config import MLAConfig, ModelConfig
from specserve.distributed import parallel_state
from specserve.layers import linear
from specserve.layers.attention_metadata import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)
from specserve.layers.backends.torch_ref import TorchRefBackend
from specserve.layers.mla import MLAAttention, choose_form, mla_softmax_scale

hf_ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
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


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_transformers(name: str, form: str) -> None:
    pair = Pair(name, form)
    for i, (kind, lens, page_size) in enumerate(CASES):
        check_schedule(pair, kind, lens, page_size, "cpu", TorchRefBackend(), seed=i)


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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tree_verify_matches_transformers(name: str) -> None:
    tree_verify(Pair(name, "auto"), "cpu", TorchRefBackend())


@pytest.mark.parametrize("form", ["compute", "absorbed"])
def test_uncached_prefill(form: str) -> None:
    """No pool bound (a profiling forward): every request a fresh prefill over its own tokens."""
    from specserve.worker.forward_batch import build_attention_metadata, build_positions

    pair = Pair("yarn_interleaved", form)
    lens = [4, 9, 1]
    xs = make_inputs(lens, pair.cfg.hidden_size, "cpu", 1)
    md = build_attention_metadata(lens, lens, [[0, 1, 2]] * 3, 4, "cpu")
    set_forward_context(ForwardContext(md, TorchRefBackend()))
    try:
        with torch.no_grad():
            out = pair.ours(build_positions(lens, lens, "cpu"), torch.cat(xs))
    finally:
        set_forward_context(None)
    for x, got in zip(xs, out.split(lens)):
        assert (got - pair.reference(x)).abs().max().item() < 1e-4


def test_tp2_heads_sum_to_tp1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank holds half the heads (q_b / kv_b column shards, o_proj row shard, the bias
    on rank 0); without the all-reduce, the two ranks' outputs sum to the TP=1 output."""
    pair = Pair("qproj_neox_bias", "auto")
    lens = [6, 3]
    xs = make_inputs(lens, pair.cfg.hidden_size, "cpu", 2)
    want = [pair.reference(x) for x in xs]
    monkeypatch.setattr(linear, "all_reduce", lambda x: x)
    total = None
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
        layer = MLAAttention(pair.config, 0)
        assert layer.num_heads == 2
        load(layer, pair.hf)
        session = PagedSession(LayerOnly(layer, torch.cat(xs)), page_size=4)
        out = torch.cat(session.step({0: list(range(6)), 1: [6, 7, 8]}, logits=False))
        total = out if total is None else total + out
    err = (total - torch.cat(want)).abs().max().item()
    assert err < 1e-4, err


def test_softmax_scale_and_form_choice() -> None:
    """Scales of the research note's real configs; the per-forward form rule at DeepSeek-V3
    dims (128 heads): a fresh prefill and a long chunk compute, decode and short chunks
    after a long context are absorbed, as is any masked or graph-captured batch."""
    dsv3 = MLAConfig(512, 128, 64, 128, 1536)
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert abs(mla_softmax_scale(dsv3, yarn) - 0.13523) < 1e-5
    assert abs(mla_softmax_scale(dsv3, {**yarn, "factor": 32.0}) - 0.13086) < 1e-5
    assert abs(mla_softmax_scale(dsv3, {**yarn, "factor": 64.0}) - 0.14468) < 1e-5
    assert mla_softmax_scale(MLAConfig(512, 192, 64, 256), None) == 256**-0.5

    def md(
        q_lens: list[int], seq_lens: list[int], host: bool = True, mask: bool = False
    ) -> AttentionMetadata:
        z = torch.zeros(1)
        return AttentionMetadata(
            z,
            z,
            z,
            z,
            max(q_lens),
            max(seq_lens),
            torch.ones(1, 1, 1, dtype=torch.bool) if mask else None,
            q_lens if host else None,
            seq_lens if host else None,
        )

    assert choose_form(md([2048], [2048]), 128, dsv3) == "compute"
    assert choose_form(md([512], [4608]), 128, dsv3) == "compute"
    assert choose_form(md([100], [4100]), 128, dsv3) == "absorbed"
    assert choose_form(md([1] * 8, [3000] * 8), 128, dsv3) == "absorbed"
    assert choose_form(md([64], [64], host=False), 128, dsv3) == "absorbed"
    assert choose_form(md([4], [500], mask=True), 128, dsv3) == "absorbed"
    assert choose_form(md([8192], [40000]), 128, dsv3) == "absorbed"  # expansion too large


def test_bad_configs() -> None:
    cfg = ModelConfig.from_hf(hf_config("yarn_interleaved").to_dict())
    with pytest.raises(ValueError, match="form must be one of"):
        MLAAttention(cfg, 0, form="fast")
    plain = ModelConfig("LlamaForCausalLM", 64, 48, 64, 1, 4, 4, 12)
    with pytest.raises(ValueError, match="needs the config's MLA fields"):
        MLAAttention(plain, 0)


# --------------------------------------------------------------------------------------------
# GPU: the Triton backend, fp32 (so the 1e-4 bound holds)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_transformers_gpu(name: str, form: str) -> None:
    from specserve.layers.backends.triton_backend import TritonBackend

    pair = Pair(name, form, "cuda")
    for i, (kind, lens, page_size) in enumerate(CASES):
        check_schedule(pair, kind, lens, page_size, "cuda", TritonBackend(), seed=i)
    tree_verify(Pair(name, "auto", "cuda"), "cuda", TritonBackend())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_cuda_graph_decode_gpu() -> None:
    """One decode forward of the layer captured in a CUDA graph (metadata without host
    lengths, as the runner's graphs build it), replayed over steps with new positions, slots,
    sequence lengths and page tables: each replay equals transformers at that position."""
    from specserve.layers.backends.triton_backend import TritonBackend

    pair = Pair("yarn_interleaved", "auto", "cuda")
    prompts, steps, h = [5, 9, 14], 6, pair.cfg.hidden_size
    xs = make_inputs([p + steps for p in prompts], h, "cuda", 9)
    session = PagedSession(
        LayerOnly(pair.ours, torch.cat([x[:p] for x, p in zip(xs, prompts)])), page_size=4
    )
    session.backend = TritonBackend()
    session.step(
        {r: list(range(sum(prompts[:r]), sum(prompts[: r + 1]))) for r in range(len(prompts))},
        logits=False,
    )
    pair.ours.rotary.ensure_capacity(256)
    bs, dev = len(prompts), "cuda"
    hidden = torch.zeros(bs, h, device=dev)
    positions = torch.zeros(bs, dtype=torch.long, device=dev)
    slots = torch.zeros(bs, dtype=torch.long, device=dev)
    seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
    page_table = torch.zeros(bs, 16, dtype=torch.int32, device=dev)
    md = AttentionMetadata(
        slots, torch.arange(bs + 1, dtype=torch.int32, device=dev), seq_lens, page_table, 1, 256
    )
    set_forward_context(ForwardContext(md, session.backend))
    try:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                pair.ours(positions, hidden)  # warm-up (compiles the kernels)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = pair.ours(positions, hidden)
    finally:
        set_forward_context(None)
    want = [pair.reference(x) for x in xs]
    for step in range(steps):
        for r, p in enumerate(prompts):
            pos = p + step
            pages = session.pages[r]
            while len(pages) * 4 <= pos:
                pages.append(session.free.pop())
            hidden[r] = xs[r][pos]
            positions[r] = pos
            slots[r] = pages[pos // 4] * 4 + pos % 4
            seq_lens[r] = pos + 1
            page_table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        graph.replay()
        for r, p in enumerate(prompts):
            err = (out[r] - want[r][p + step]).abs().max().item()
            assert err < 1e-4, f"step {step} request {r}: max abs diff {err:.3g}"
