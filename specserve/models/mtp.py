"""MTP / NextN layers: the extra decoder layers some checkpoints store past the decoder stack
(DeepSeek-V3 layer 61, GLM-4.5 92, GLM-4.5-Air 46, GLM-4.7-Flash 47, GLM-5 78).

MTP layer i lives at `model.layers.{num_hidden_layers + i}.*` for i < num_nextn_predict_layers:
a full decoder layer of the model's own kind (`input_layernorm`, `self_attn.*`,
`post_attention_layernorm`, `mlp.*`) plus the NextN parts
    enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], shared_head.norm.weight [H]
and optionally copies of the embedding and the head (`embed_tokens.weight`,
`shared_head.head.weight`). It predicts token t + 2 from token t + 1 and the target's hidden
state at t:
    h' = eh_proj([enorm(embed(token t + 1)) | hnorm(h_t)]);  logits = head(shared_head.norm(layer(h')))
The base models recognise these tensors and skip them (one log line per layer); `mtp_layer`
names which layer a tensor belongs to, for a drafter that loads them.
"""

from __future__ import annotations

import re

# parts an MTP layer has beyond a decoder layer's
NEXTN_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def mtp_layer(name: str, num_layers: int, num_mtp_layers: int) -> int | None:
    """i if checkpoint tensor `name` belongs to MTP layer i (0-based), else None (a decoder
    layer's, a global tensor, or a layer index no MTP layer the config declares has)."""
    match = _LAYER.match(name)
    if match is None:
        return None
    i = int(match.group(1)) - num_layers
    return i if 0 <= i < num_mtp_layers else None


def is_nextn_part(name: str) -> bool:
    """Whether an MTP layer's tensor is one of the NextN parts (not its decoder layer)."""
    match = _LAYER.match(name)
    return match is not None and match.group(2).split(".")[0] in NEXTN_PARTS
