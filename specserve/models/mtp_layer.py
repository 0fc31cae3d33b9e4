"""The MTP / NextN layer as a module: built from the target's own decoder factories, loaded
from the target's own files (names in models/mtp.py).

    x      = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])     # [T, 2H] -> [T, H], embedding first
    out    = block(x)                                          # a decoder layer of the target's kind
    logits = head(shared_head.norm(out))
h_i is the target's FINAL hidden state at position i (after the final norm: what the target's
LM head reads; models/capture.py's final_hidden_id) for the first step, and the layer's own
`out` (before shared_head.norm) for the steps after it. This is the convention of vLLM
(`deepseek_mtp.py` feeds the hidden states the target model returns, post-norm), SGLang
(`deepseek_nextn.py`) and transformers 5.24 (`MTPCandidateGenerator` reads hidden_states[-1],
which it ties to the post-norm last_hidden_state); the DeepSeek-V3 report's figure can be read
as the stream before the main model's output head (pre-norm), but the engines whose measured
acceptance matches the report all feed the post-norm state, so we do.

The block is the target's own: its attention comes from the target's DecoderModel factory
(MLA for DeepSeek-V3 / GLM-4.7-Flash, GQA with QK-norm and partial RoPE for GLM-4.5; sharded
for TP like the target's layers, the same rotary module), its feed-forward is a MoE block when
the checkpoint stores routed experts for the layer, else a dense MLP. The embedding and head
are the layer's own copies when the checkpoint stores them (`embed_tokens.weight`,
`shared_head.head.weight`) and differ from the target's; otherwise the target's, by reference.

GLM-5 (DSA targets): the block's attention is a DSAAttention with an indexer of its own, read
from `self_attn.indexer.{wq_b,wk,weights_proj}.weight` and `self_attn.indexer.k_norm.{weight,
bias}` below the layer's prefix, the names every full layer of the target uses (research notes
1.6: the MTP layer `model.layers.78.*` is a full decoder layer of the target's kind; 1.2 / 5:
an indexer's tensors sit at `self_attn.indexer.*` of its layer; no other spelling is known
for layer 78), so its pool layer is KVCacheSpec.dsa (latent page + index-key page) like a target full layer's.
It is never "shared" (GLM-5.2's indexer_types), whatever the config lists: a shared layer
reuses the slots the previous full layer picked in the same forward, and the MTP layer runs in
forwards of its own, over positions and scratch slots the target never scored, so there is no
selection to reuse; a checkpoint without the indexer's tensors is refused, naming the first
missing one. Dense MLA while a forward's sequences fit in index_topk, the indexer's top-k past
it (layers/dsa.py's rule, on the MTP layer's own metadata: the chained draft steps see the
draft prefix plus their ancestors among the scratch slots through the custom mask, which the
index scores honour like the attention).
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import ReplicatedLinear
from specserve.layers.mlp import GatedMLP
from specserve.layers.moe import DeepseekMoE
from specserve.layers.norm import RMSNorm
from specserve.models.capture import find_decoder_layers, find_embedding_and_head
from specserve.models.decoder import CausalLM, DecoderLayer, DecoderModel, quant_config

log = logging.getLogger(__name__)

# the tensors every MTP layer has (besides its block's attention and MLP tensors)
REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")
# and, for a DSA target (GLM-5), the MTP layer's own indexer
DSA_REQUIRED = tuple(f"self_attn.indexer.{t}" for t in (
    "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"))
# the checkpoint copies that may replace the target's embedding and head
OWN_EMBED, OWN_HEAD = "embed_tokens.weight", "shared_head.head.weight"


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if own_head:
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class MTPLayer(DecoderLayer):
    """One MTP layer; parameter names are the checkpoint's below `model.layers.{N}.`."""

    def __init__(self, config: ModelConfig, target: nn.Module, moe: bool, own_embed: bool,
                 own_head: bool) -> None:
        decoder = find_decoder_model(target)
        n, h = config.num_layers, config.hidden_size
        name = f"{decoder.layer_prefix}.{n}"
        quant = quant_config(config)
        if moe:
            if config.moe is None:
                raise ValueError(f"the MTP layer {name} stores routed experts but the config "
                                 "has no MoE fields")
            mlp = DeepseekMoE(h, config.moe, config.hidden_act, False, quant, f"{name}.mlp")
        else:
            mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, False, quant,
                           f"{name}.mlp")
        super().__init__(config, decoder.attention_factory(n, f"{name}.self_attn"), mlp)
        self.config = config
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.shared_head = SharedHead(config, own_head)
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h)
        embed, head = find_embedding_and_head(target)
        # the target's modules, kept out of this module's parameters (never loaded or cast here)
        self._shared = {"embed": embed, "lm_head": head}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = getattr(self, "embed_tokens", None)
        return (self._shared["embed"] if table is None else table)(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                g: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; g [T, H]: the target's final hidden state or this layer's
        previous output. Returns out [T, H] (the residual stream leaving the block)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(g)], dim=-1))
        hidden, residual = super().forward(positions, x, None)
        _, out = self.shared_head.norm.reduce_add(hidden, residual)  # all-reduce + residual
        return out

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        # [n, H] -> [n, vocab] float32
        head = getattr(self.shared_head, "head", None)
        head = self._shared["lm_head"] if head is None else head
        return head.compute_logits(self.shared_head.norm(out)).float()

    def share_equal_copies(self) -> None:
        """Drop a loaded embedding / head copy equal to the target's (DeepSeek-V3 ships both
        as copies): the target's module serves, and the memory is freed."""
        pairs = (("embed_tokens", self, "embed"), ("head", self.shared_head, "lm_head"))
        for attr, owner, shared in pairs:
            own = getattr(owner, attr, None)
            if own is not None and torch.equal(own.weight, self._shared[shared].weight):
                delattr(owner, attr)
                log.info("MTP layer: %s equals the target's; sharing it", attr)


def find_decoder_model(target: nn.Module) -> DecoderModel:
    """The DecoderModel holding the target's decoder layers (found by structure)."""
    layers = find_decoder_layers(target)
    parent = next(m for m in target.modules() if any(c is layers for c in m.children()))
    if not isinstance(parent, DecoderModel):
        raise ValueError(f"{type(target).__name__}: MTP drafting needs the shared decoder "
                         f"(models/decoder.py), found {type(parent).__name__}")
    return parent


def find_causal_lm(target: nn.Module) -> CausalLM:
    return next(m for m in target.modules() if isinstance(m, CausalLM))


# -- the checkpoint ------------------------------------------------------------------------

def mtp_prefix(config: ModelConfig) -> str:
    return f"model.layers.{config.num_layers}."


def tensor_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> its safetensors file (names only: nothing is read)."""
    from safetensors import safe_open

    from specserve.models.loader import weight_files

    if not os.path.isdir(path):
        raise ValueError(f"speculative method mtp reads a checkpoint directory; {path} is not one")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return {n: os.path.join(path, f) for n, f in json.load(fh)["weight_map"].items()}
    out = {}
    for file in weight_files(path):
        if not file.endswith(".safetensors"):
            raise ValueError(f"MTP drafting reads safetensors checkpoints; {path} has {file}")
        with safe_open(file, framework="pt", device="cpu") as fh:
            out.update(dict.fromkeys(fh.keys(), file))
    return out


def check_mtp_checkpoint(path: str | None, config: ModelConfig) -> list[str]:
    """The MTP layer's tensor names (prefix stripped), or ValueError in one line naming what is
    missing: the config's num_nextn_predict_layers, or a tensor. path None: random weights."""
    if config.num_mtp_layers < 1:
        raise ValueError(
            f"speculative method mtp: the target's config.json has no MTP layer "
            f"(num_nextn_predict_layers is {config.num_mtp_layers or 'absent'}); "
            "use a checkpoint that ships one (DeepSeek-V3, GLM-4.5+) or another method")
    if config.num_mtp_layers > 1:
        log.info("the checkpoint declares %d MTP layers; drafting chains the first",
                 config.num_mtp_layers)
    if path is None:
        return []
    prefix = mtp_prefix(config)
    names = [n[len(prefix):] for n in tensor_files(path) if n.startswith(prefix)]
    for req in (*REQUIRED, *(DSA_REQUIRED if config.dsa is not None else ())):
        if req not in names:
            raise ValueError(f"speculative method mtp: the checkpoint at {path} lacks the MTP "
                             f"tensor {prefix}{req} (num_nextn_predict_layers is "
                             f"{config.num_mtp_layers})")
    return names


def load_mtp_layer(path: str | None, target: nn.Module, config: ModelConfig,
                   dtype: torch.dtype, device: torch.device, seed: int = 0) -> MTPLayer:
    """The MTP layer for this TP rank from the checkpoint at `path` (None: random weights for
    cost benchmarks, MoE when the target is)."""
    from safetensors import safe_open

    from specserve.layers.quantization import process_weights_after_loading
    from specserve.models.weights import load_named_weights

    names = check_mtp_checkpoint(path, config)
    moe = any(n.startswith("mlp.experts.") for n in names) if path else config.moe is not None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            layer = MTPLayer(config, target, moe, OWN_EMBED in names, OWN_HEAD in names)
    finally:
        torch.set_default_dtype(previous)
    if path is None:
        from specserve.models.presets import random_init

        random_init(layer, seed)
        return layer.eval()
    prefix, files = mtp_prefix(config), tensor_files(path)

    def weights():
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(files[prefix + n], []).append(n)
        for file, group in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as fh:
                for n in group:
                    yield n, fh.get_tensor(prefix + n)

    try:
        load_named_weights(layer, weights(), find_causal_lm(target).stacked,
                           f"the MTP layer ({prefix}*)")
    except ValueError as exc:
        raise ValueError(f"speculative method mtp: {exc} (below {prefix})") from None
    process_weights_after_loading(layer)
    layer.share_equal_copies()
    return layer.eval()
