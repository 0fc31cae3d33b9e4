"""The pre-norm decoder every supported family shares; a family supplies its attention and
feed-forward modules per layer (llama: GQA + gated MLP; DeepSeek-V3: MLA + dense-or-MoE).

Decoder layers pass (hidden, residual) so each residual add is fused into the next RMSNorm:
    layer 0:  residual = x;            h = attn(norm(x))
    layer i:  h, residual = norm(all_reduce(h) + residual) ...
Under tensor parallelism `hidden` between sub-layers is this rank's partial sum: the attention
and feed-forward modules do not reduce their outputs, and `RMSNorm.reduce_add` all-reduces
each together with the residual add and the norm (one launch where the backend can; at TP 1
exactly `norm(h, residual)`). The residual stream entering layer i is `residual` after its
first norm (the embedding for layer 0); the layer hands it to `observe_stream` when
aux-hidden-state capture sets one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.norm import RMSNorm
from specserve.layers.quantization import QuantConfig, get_quant_config
from specserve.models.mtp import mtp_layer
from specserve.models.weights import Stacked, load_named_weights

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """self_attn(positions, hidden) -> [T, H]; mlp(hidden) -> [T, H]: both this rank's partial
    sums (built with reduce_output=False)."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        # each norm's output is the whole input of the linears the sub-layer names
        # (input_projs): FP8 ones then take their rows quantized by the norm's kernel
        self.input_layernorm.feeds(*getattr(self_attn, "input_projs", ()))
        self.post_attention_layernorm.feeds(*getattr(mlp, "input_projs", ()))
        # called with the residual stream entering the layer [T, H] (aux-state capture)
        self.observe_stream: Callable[[torch.Tensor], None] | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: the embedding (residual None: layer 0), else the previous mlp's partial sum
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.reduce_add(hidden, residual)
        if self.observe_stream is not None:
            self.observe_stream(residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm.reduce_add(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm: layer i = DecoderLayer(attention(i, name),
    mlp(i, name)), each module given its checkpoint name (`model.layers.i.self_attn`,
    `model.layers.i.mlp`; the quantization config picks formats by it). `rotary` is shared by
    the layers' attention modules."""

    def __init__(
        self, config: ModelConfig, rotary: nn.Module,
        attention: Callable[[int, str], nn.Module], mlp: Callable[[int, str], nn.Module],
        prefix: str = "model",
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention(i, f"{prefix}.layers.{i}.self_attn"),
                         mlp(i, f"{prefix}.layers.{i}.mlp"))
            for i in range(config.num_layers)
        )  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the family's attention factory and the layers' name prefix: an MTP / NextN layer
        # (speculative/mtp.py) builds its decoder block's attention the same way
        self.attention_factory = attention
        self.layer_prefix = f"{prefix}.layers"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm.reduce_add(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A DecoderModel plus the LM head: the interface the engine drives.

    Subclasses set `stacked` (checkpoint fragments fused into our parameters) and may extend
    `skip_weight` (checkpoint tensors the model does not use). A subclass builds its layers
    with `quant_config(config)`, the checkpoint's quantization (None: dense). The tensors of
    the MTP / NextN layers the config declares (models/mtp.py) are recognised and skipped."""

    stacked: Stacked = ()

    def __init__(self, config: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config(config)
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._mtp_skipped: set[int] = set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> final-normed hidden [T, H]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [n, H] -> [n, vocab] float32, full vocabulary on every rank
        return self.lm_head.compute_logits(hidden).float()

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def skip_weight(self, name: str) -> bool:
        layer = mtp_layer(name, self.config.num_layers, self.config.num_mtp_layers)
        if layer is not None:
            if layer not in self._mtp_skipped:
                self._mtp_skipped.add(layer)
                log.info(
                    "skipping the weights of MTP/NextN layer %d (model.layers.%d; the "
                    "mtp drafter loads them itself)",
                    layer,
                    self.config.num_layers + layer,
                )
            return True
        if self.quant_config is not None and self.quant_config.skips_tensor(name):
            return True
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (see models/weights.py)."""
        load_named_weights(self, weights, self.stacked, self.config.architecture,
                           skip=self.skip_weight)  # fmt: skip


def quant_config(config: ModelConfig) -> QuantConfig | None:
    """The checkpoint's quantization (parsed once per config; None: dense)."""
    return get_quant_config(config.quantization)
