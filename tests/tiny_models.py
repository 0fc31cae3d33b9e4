"""Tiny random transformers checkpoints for numerics tests (built locally, no downloads)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

# params of a device fixture: every test on the CPU and, marked gpu, on CUDA
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def device_fixture(module_globals: dict):
    """A module-scoped autouse `device` fixture over DEVICES that also sets the module's
    DEVICE (read by its helpers); CUDA is skipped without a GPU. Use it as
    `device = device_fixture(globals())`."""

    @pytest.fixture(scope="module", autouse=True, params=DEVICES)
    def device(request: pytest.FixtureRequest) -> str:
        if request.param == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        module_globals["DEVICE"] = request.param
        return request.param

    return device


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3", "deepseek_v2", "glm4_moe",
            "glm4_moe_lite", "glm_moe_dsa")

# a yarn rope like Kimi K2's (beta_fast = beta_slow = 1), scaled 4x from 128 positions
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# DeepSeek-V3 shapes shrunk (research note section 5): MLA, 8 routed experts in 4 groups of which
# 2 are kept, top 2, one shared expert, layer 0 dense, no MTP layer
DEEPSEEK_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    num_mtp_layers=0,
    rope_parameters=DEEPSEEK_YARN,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# the MoE part every GLM flavour shares (GLM routing: one group), 3 layers, layer 0 dense
_GLM_MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# GLM-4.5 (355B flavour) shrunk: GQA 4 / 2 with an explicit head_dim (not hidden / heads), q/k/v
# bias, QK-norm, RoPE on half of each head (saved nested in rope_parameters), no MTP layer
GLM4_MOE_TINY = dict(
    _GLM_MOE,
    num_key_value_heads=2,
    head_dim=32,
    first_k_dense_replace=1,
    attention_bias=True,
    use_qk_norm=True,
    routed_scaling_factor=2.5,
    partial_rotary_factor=0.5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    num_mtp_layers=0,
)
# GLM-4.7-Flash shrunk: MLA with v_head_dim != qk_nope_head_dim (192 / 256 in the real model)
GLM4_MOE_LITE_TINY = dict(
    _GLM_MOE,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=24,
    v_head_dim=32,
    routed_scaling_factor=1.8,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
# GLM-5 shrunk: GLM-4.7-Flash's MLA plus the indexer (8 heads of 16 dims: ties between scores,
# e.g. two all-zero relu sums at the top-k boundary, stay improbable); index_topk above any
# test length = dense MLA, small = sparse attention
GLM_MOE_DSA_TINY = dict(
    GLM4_MOE_LITE_TINY,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    index_topk=4096,
    index_head_dim=16,
    index_n_heads=8,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _classes(family: str) -> tuple[type, type, str]:
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, "LlamaForCausalLM"),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, "Qwen2ForCausalLM"),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, "Qwen3ForCausalLM"),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, "MistralForCausalLM"),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, "DeepseekV3ForCausalLM"),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, "DeepseekV2ForCausalLM"),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, "Glm4MoeForCausalLM"),
        "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM,
                          "Glm4MoeLiteForCausalLM"),
    }
    if family == "glm_moe_dsa":  # transformers >= 5.2
        cls = getattr(tf, "GlmMoeDsaForCausalLM", None)
        if cls is None:
            import pytest

            pytest.skip("this transformers has no GlmMoeDsaForCausalLM (needs >= 5.2)")
        table[family] = (tf.GlmMoeDsaConfig, cls, "GlmMoeDsaForCausalLM")
    if family not in table:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    return table[family]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace the init (zero biases, unit norms, tiny weights) with values that exercise every
    parameter: a bias or norm weight left at its init would hide a loading bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias"):  # linear biases and LayerNorm shifts (GLM-5's k_norm)
                p.copy_(0.2 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection only; some negative
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def make_hf_model(
    family: str = "llama", seed: int = 0, vocab_size: int = 512, **config_overrides: object
) -> torch.nn.Module:
    """The transformers model (fp32, eager attention, eval) with random weights."""
    config_cls, model_cls, arch = _classes(family)
    kwargs: dict = dict(vocab_size=vocab_size, architectures=[arch])
    glm = {"glm4_moe": GLM4_MOE_TINY, "glm4_moe_lite": GLM4_MOE_LITE_TINY,
           "glm_moe_dsa": GLM_MOE_DSA_TINY}
    if family in glm:
        kwargs.update(glm[family])
    elif family.startswith("deepseek"):
        kwargs.update(DEEPSEEK_TINY)
        if family == "deepseek_v2":  # softmax routing, no correction bias, plain rope
            kwargs.update(topk_method="group_limited_greedy", norm_topk_prob=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            kwargs.pop("num_mtp_layers")
    else:
        kwargs.update(_llama_kwargs(family))
    # transformers normalises rope dicts in place: give it copies, never the callers' (shared)
    kwargs.update(copy.deepcopy(config_overrides))
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize(model, seed)
    return model


def _llama_kwargs(family: str) -> dict:
    kwargs: dict = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 declares head_dim; make it differ from hidden / heads
    return kwargs


def make_tiny_checkpoint(
    path: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    tokenizer: bool = False,
    max_shard_size: str | int | None = None,
    hub_config: bool = False,
    **config_overrides: object,
) -> str:
    """Save a tiny random `family` checkpoint (config.json + fp32 safetensors) at `path`.

    config_overrides go to the transformers config, e.g. tie_word_embeddings=True,
    rope_scaling=LLAMA3_ROPE, head_dim=32, num_hidden_layers=4. max_shard_size="20KB"
    writes a sharded checkpoint with model.safetensors.index.json; hub_config rewrites
    config.json in the hub's spelling (`hub_spelling`).
    """
    path = os.fspath(path)
    model = make_hf_model(family, seed, vocab_size, **config_overrides)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    if hub_config:
        edit_config(path, hub_spelling)
    if tokenizer:
        _add_tokenizer(path, vocab_size)
    return path


def edit_config(path: str, edit) -> None:  # noqa: ANN001
    """Rewrite `path`/config.json through edit(config dict) (in place)."""
    import json

    file = os.path.join(path, "config.json")
    with open(file) as fh:
        config = json.load(fh)
    edit(config)
    with open(file, "w") as fh:
        json.dump(config, fh)


def hub_spelling(config: dict) -> None:
    """transformers' saved config -> the hub's spelling: rope_theta, rope_scaling (with
    "type") and partial_rotary_factor at the top level instead of rope_parameters."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    if kind != "default":
        config["rope_scaling"] = {"type": kind, **rope}


def _add_tokenizer(path: str, vocab_size: int) -> None:
    try:
        from tiny_tokenizer import make_tiny_tokenizer
    except ImportError:
        from tests.tiny_tokenizer import make_tiny_tokenizer
    make_tiny_tokenizer(path, vocab_size=vocab_size)


def make_kimi_k25_checkpoint(
    path: str | os.PathLike, seed: int = 0, vocab_size: int = 512, nvfp4_names: bool = False,
    **config_overrides: object,
) -> str:  # fmt: skip
    """A Kimi K2.5 wrapper checkpoint written by hand (transformers' own save writes
    `language_model.model.blocks.*`, not the hub's names): the tiny DeepseekV3 with Kimi's
    routing (one group) that `make_hf_model("deepseek_v3", seed, vocab_size, n_group=1,
    topk_group=1, **config_overrides)` builds, its tensors under `language_model.` (layers as
    `language_model.layers.*` with nvfp4_names, as NVIDIA's exports spell them), a few vision
    tensors, the wrapper config.json with the text config in the hub's spelling, and a
    tokenizer."""
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    overrides = {"n_group": 1, "topk_group": 1, **config_overrides}
    model = make_hf_model("deepseek_v3", seed, vocab_size, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # per-expert tensor names
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if nvfp4_names and name.startswith("model.layers."):
            name = name[len("model.") :]
        out["language_model." + name] = t
    gen = torch.Generator().manual_seed(seed)
    out["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(96, 32, generator=gen)
    out["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 2, generator=gen)
    out["mm_projector.proj.0.weight"] = torch.randn(64, 32, generator=gen)
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    text = model.config.to_dict()
    hub_spelling(text)
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "tie_word_embeddings": False, "media_placeholder_token_id": 163605,
        "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 32},
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    _add_tokenizer(path, vocab_size)
    return path
