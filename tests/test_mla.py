"""The MLA layer (layers/mla.py) against transformers' DeepseekV3Attention, fp32, on the CPU
with the torch backend, over the tiny configs of mla_reference.py: batched prefill, chunked
extend over a paged cache (shuffled pages), decode, and a tree-masked verify, at every position
(< 1e-4), in the compute form, the absorbed form and the per-forward choice; q_lora_rank set and
None, interleaved and rotate-half rope, default and yarn rope (mscale != mscale_all_dim: the
cos/sin factor and the softmax correction both matter), biases, page sizes 1/4/16, no pool
bound. TP over heads: two ranks' partial outputs sum to the TP=1 output. The softmax scale at
real configs and the per-forward form rule. The Triton backend's runs are in
test_mla_gpu.py."""

from __future__ import annotations

import pytest
import torch
from engine_drivers import PagedSession
from mla_reference import (
    CASES,
    CONFIGS,
    FORMS,
    LayerOnly,
    Pair,
    check_schedule,
    hf_config,
    load,
    make_inputs,
    tree_verify,
)

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


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_transformers(name: str, form: str) -> None:
    pair = Pair(name, form)
    for i, (kind, lens, page_size) in enumerate(CASES):
        check_schedule(pair, kind, lens, page_size, "cpu", TorchRefBackend(), seed=i)


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
