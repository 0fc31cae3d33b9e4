"""Read a GGUF file (llama.cpp's format): the model's config, and its tensors dequantized and
renamed to the Hugging Face names `load_weights` takes.

Supported architectures: llama (also Mistral, which llama.cpp files as llama), qwen2, qwen3.
Tensor types: anything `gguf.quants.dequantize` handles (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K..Q6_K, ...); every tensor is dequantized to float32 here and cast to the
engine dtype by the parameter's loader, so the engine computes in its own dtype.

llama.cpp stores llama's q and k projections with their rows permuted per head (its RoPE
rotates interleaved pairs (x[2i], x[2i+1]); ours rotates (x[i], x[i + d/2])): the rows are put
back before loading. Qwen2/Qwen3 files keep the Hugging Face order (llama.cpp rotates them in
the half-split "NeoX" layout).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# general.architecture -> (our architecture name, q/k rows stored permuted for interleaved RoPE)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# GGUF tensor-name fragment -> Hugging Face name fragment (inside blk.N / model.layers.N)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str) -> bool:
    """Whether `path` names a GGUF file (by its name; the reader checks the magic)."""
    return path.lower().endswith(".gguf")


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def open_gguf(path: str) -> Any:
    """The file's `gguf.GGUFReader`, parsed once per process (its metadata parse takes seconds
    on a large vocabulary) and re-read when the file changes."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ValueError("reading GGUF files needs the gguf package: pip install gguf") from e
    real = os.path.realpath(path)
    return _reader(real, os.stat(real).st_mtime_ns)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any) -> tuple[str, str, bool]:
    """(GGUF architecture, our architecture name, q/k rows permuted)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return (arch, *ARCHITECTURES[arch])


def hf_config(path: str) -> dict[str, Any]:
    """A Hugging Face config.json dict for the model in the GGUF file at `path`."""
    reader = open_gguf(path)
    arch, hf_arch, _ = architecture(reader)

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path} carries per-dimension RoPE frequency factors (rope_freqs, as "
            "Llama 3.1+ files do), which this loader does not apply yet"
        )
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"{path}: RoPE over {rope_dim} of {head_dim} head dims (partial "
            "rotary) is not supported"
        )
    embed = tensors["token_embd.weight"]
    vocab = meta("vocab_size") or int(embed.shape[1])
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_sliding_window": False,
        "torch_dtype": _checkpoint_dtype(reader),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader),
    }
    scaling = _rope_scaling(meta)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _eos_ids(reader: Any) -> list[int]:
    """End-of-sequence, end-of-turn and end-of-message ids, as llama.cpp stops on each."""
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(meta: Any) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn)")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(meta("rope.scaling.factor", 1.0))}
    orig = meta("rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _checkpoint_dtype(reader: Any) -> str:
    """The half dtype a GPU should compute this model in: the file's own float type where its
    matrices are stored unquantized, bf16 for quantized files."""
    from gguf import GGMLQuantizationType as Q

    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if kinds <= {Q.F16}:
        return "float16"
    if kinds <= {Q.F32}:
        return "float32"
    return "bfloat16"


def hf_name(name: str) -> str:
    """The Hugging Face parameter name of GGUF tensor `name`."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no place in the supported architectures")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def dequantize(tensor: Any) -> torch.Tensor:
    """One `gguf` ReaderTensor as a float32 torch tensor in torch's (row-major) shape."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    if tensor.tensor_type == Q.F32:
        out = torch.from_numpy(data.view(np.float32).copy())
    elif tensor.tensor_type == Q.F16:
        out = torch.from_numpy(data.view(np.float16).astype(np.float32))
    else:
        try:
            values = gguf_dequantize(data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name} "
                "cannot be dequantized by the gguf package"
            ) from e
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return out.reshape(shape)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order for interleaved RoPE: within each head, row 2i
    came from row i and row 2i+1 from row i + d/2 (w: [heads * d, ...] or a bias [heads * d])."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 CPU tensor) for every tensor of the GGUF file."""
    reader = open_gguf(path)
    arch, _, permuted = architecture(reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        w = dequantize(tensor)
        if permuted and ".q_proj." in name:
            w = unpermute_rows(w, heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rows(w, kv_heads)
        yield name, w
