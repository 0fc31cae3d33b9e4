"""MTPProposer: drafting with the target's own MTP / NextN layer (DeepSeek-V3, GLM-4.5+, GLM-5).

`--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`: no draft model; the
layer `model.layers.{num_hidden_layers}` is read from the target's own files
(models/mtp_layer.py has its math and which hidden state it reads). A chain of K steps reuses
the one layer (vLLM's and SGLang's practice for K > num_nextn_predict_layers); trees work the
same way (topk > 1), as for EAGLE-3.

It is EAGLE-3's drafting loop (speculative/eagle3.py) over another head, with the same
positions: draft position i pairs the target's final hidden state h_i with token t_{i+1} and
writes the layer's KV (the target's KV kind: an MLA latent page for MLA targets, the latent
and the indexer's key page for DSA targets, GLM-5) at position i of the request's pages; the
state row is the layer's output at P - 1; step s >= 2 feeds the layer its own previous
output. The feature is the target's final hidden state, captured
through models/capture.py's final_hidden_id (a forward hook on the target: no model code).
"""

from __future__ import annotations

import dataclasses

import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.kv_cache.spec import KVCacheSpec
from specserve.layers.attention import attention_modules
from specserve.layers.rotary import ensure_rope_capacity
from specserve.models.capture import final_hidden_id
from specserve.models.mtp_layer import check_mtp_checkpoint, find_decoder_model, load_mtp_layer
from specserve.speculative.eagle3 import Eagle3Proposer
from specserve.speculative.features import bind_draft_layers
from specserve.speculative.proposer import DraftShape


def check_mtp_target(spec: SpecConfig, model_path: str | None,
                     config: ModelConfig) -> ModelConfig:
    """Before the engine builds: the target declares an MTP layer and (unless its weights are
    random) its files hold the layer's tensors; ValueError in one line naming what is missing.
    Returns a config whose parameter count is the layer's block (for the memory check: one
    decoder layer, MoE when the target has experts, eh_proj and the enorm/hnorm pair; no
    embedding or head of its own)."""
    DraftShape.from_config(spec)  # validates the tree size
    check_mtp_checkpoint(model_path, config)
    h = config.hidden_size
    return dataclasses.replace(_one_layer(config), vocab_size=0, tie_word_embeddings=True,
                               quantization=None, extra_parameters=2 * h * h + 2 * h)


def _one_layer(config: ModelConfig) -> ModelConfig:
    """The target's config cut to one decoder layer, MoE when the target has experts, a full
    DSA layer (its own indexer) when the target has DSA, as the MTP layer is."""
    moe = config.moe and dataclasses.replace(config.moe, first_k_dense_replace=0,
                                             moe_layer_freq=1, mlp_layer_types=None)
    dsa = config.dsa and dataclasses.replace(config.dsa, indexer_types=None)
    return dataclasses.replace(config, num_layers=1, moe=moe, dsa=dsa)


def mtp_kv_specs(config: ModelConfig) -> list[KVCacheSpec]:
    """The one KV layer the MTP layer adds to the pool: its attention's (the target's kind,
    heads local to this TP rank; KVCacheSpec.dsa for GLM-5's), read from a one-layer build of
    the target on the meta device."""
    from specserve.models.loader import build_model

    decoder = find_decoder_model(build_model(_one_layer(config), torch.float32, "meta"))
    return [m.kv_spec for m in attention_modules(decoder.attention_factory(config.num_layers,
                                                                           "mtp"))]


class MTPProposer(Eagle3Proposer):
    needs_target_features = True
    keeps_state = True

    def __init__(self, spec: SpecConfig, model_path: str | None, runner) -> None:
        """model_path: the target's checkpoint directory (None: random weights)."""
        self.runner = runner
        cfg = runner.model_config
        random = model_path is None or runner.config.load_format == "dummy"
        self.head = load_mtp_layer(None if random else model_path, runner.model, cfg,
                                   runner.dtype, runner.device, seed=runner.config.seed + 1)
        self.num_kv_layers = 1
        ensure_rope_capacity(self.head, runner.max_positions)
        bind_draft_layers(runner, attention_modules(self.head))
        self.aux_layer_ids = (final_hidden_id(runner.model),)
        self.d2t = None  # the target's vocabulary
        self.state_dim = cfg.hidden_size
        self.state_dtype = runner.dtype
        # the draft KV of a page is a function of its tokens given the checkpoint's MTP layer
        source = f"random seed {runner.config.seed + 1}" if random else model_path
        self.prefix_cache_key = f"mtp layer {cfg.num_layers} of {source}"
