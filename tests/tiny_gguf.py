"""Tiny random GGUF files for tests, written with gguf.GGUFWriter as llama.cpp lays them out.

`write_tiny_gguf(path, family, qtypes)` stores a random decoder of the llama family with the
tiny byte-level BPE tokenizer (tests/tiny_tokenizer.py) in the file's metadata. Matrices are
stored in the ggml types `qtypes` names (per tensor-name suffix); quantized legacy types go
through gguf.quants.quantize, K-quant blocks (which gguf cannot quantize) are random bytes with
valid fp16 scales. llama's q/k rows are permuted for interleaved RoPE as llama.cpp's converter
does; qwen2/qwen3 keep the Hugging Face order.
"""

from __future__ import annotations

import os

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
# Qwen3 declares its head size (attention.key_length); 128 as in the released models (and as
# transformers' Qwen3 config assumes), unlike HIDDEN // HEADS
QWEN3_HEAD_DIM = 128

# one layout exercising every common type; names are GGUF names without ".weight"
MIXED = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "blk.0.attn_q": "Q4_0",
    "blk.0.attn_k": "Q4_1",
    "blk.0.attn_v": "Q5_0",
    "blk.0.attn_output": "Q5_1",
    "blk.0.ffn_gate": "Q4_K",
    "blk.0.ffn_up": "Q5_K",
    "blk.0.ffn_down": "F16",
    "blk.1.attn_q": "BF16",
    "blk.1.attn_k": "Q8_0",
    "blk.1.attn_v": "F32",
    "blk.1.attn_output": "Q6_K",
    "blk.1.ffn_gate": "Q4_1",
    "blk.1.ffn_up": "Q4_0",
    "blk.1.ffn_down": "Q4_K",
}
# K-quant block layouts: (bytes per 256 values, [(byte offset of an fp16 scale, magnitude)])
_K_BLOCKS = {
    "Q4_K": (144, [(0, 2e-4), (2, 2e-4)]),
    "Q5_K": (176, [(0, 1e-4), (2, 1e-4)]),
    "Q6_K": (210, [(208, 1.5e-5)]),
}


def _tokenizer_fields() -> dict:
    """tokens, token types, merges, special ids and chat template of the tiny BPE tokenizer."""
    import json
    import tempfile

    try:
        from tiny_tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer
    except ImportError:
        from tests.tiny_tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_tokenizer(tmp)
        with open(os.path.join(tmp, "tokenizer.json")) as fh:
            spec = json.load(fh)
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return dict(
        tokens=tokens,
        types=[3 if t in special else 1 for t in tokens],
        merges=merges,
        bos=tokens.index("<|bos|>"),
        eos=tokens.index("<|eos|>"),
        template=CHAT_TEMPLATE,
    )


def _shapes(family: str, vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    hd = QWEN3_HEAD_DIM if family == "qwen3" else HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (vocab, HIDDEN), "output_norm": (HIDDEN,)}
    if not tied:
        shapes["output"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes.update(
            {
                b + "attn_norm": (HIDDEN,),
                b + "ffn_norm": (HIDDEN,),
                b + "attn_q": (HEADS * hd, HIDDEN),
                b + "attn_k": (KV_HEADS * hd, HIDDEN),
                b + "attn_v": (KV_HEADS * hd, HIDDEN),
                b + "attn_output": (HIDDEN, HEADS * hd),
                b + "ffn_gate": (INTER, HIDDEN),
                b + "ffn_up": (INTER, HIDDEN),
                b + "ffn_down": (HIDDEN, INTER),
            }
        )
        if family == "qwen2":
            shapes.update(
                {
                    b + "attn_q.bias": (HEADS * hd,),
                    b + "attn_k.bias": (KV_HEADS * hd,),
                    b + "attn_v.bias": (KV_HEADS * hd,),
                }
            )
        if family == "qwen3":
            shapes.update({b + "attn_q_norm": (hd,), b + "attn_k_norm": (hd,)})
    return shapes


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from half-split to interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    q = Q[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype not in _K_BLOCKS:
        return quantize(w.astype(np.float32), q), q
    block_bytes, scales = _K_BLOCKS[qtype]
    rows, cols = w.shape
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset, mag in scales:
        d = rng.uniform(0.5 * mag, mag, (rows, cols // 256)).astype(np.float16)
        blocks[..., offset : offset + 2] = d[..., None].view(np.uint8)
    return blocks.reshape(rows, -1), q


def write_tiny_gguf(
    path: str,
    family: str = "llama",
    qtypes: dict[str, str] | None = None,
    tied: bool = False,
    seed: int = 0,
) -> str:
    """Write the file; return its path. qtypes maps a tensor name (no ".weight") to a ggml
    type name; matrices not named are F32, as are norms and biases."""
    import gguf

    qtypes = qtypes or {}
    tok = _tokenizer_fields()
    vocab = len(tok["tokens"])
    rng = np.random.default_rng(seed)
    hd = QWEN3_HEAD_DIM if family == "qwen3" else HIDDEN // HEADS
    w = gguf.GGUFWriter(path, family)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["template"])
    for name, shape in _shapes(family, vocab, tied).items():
        if len(shape) == 1:
            scale = 0.2 if name.endswith(".bias") else None
            values = (
                scale * rng.standard_normal(shape)
                if scale
                else 1.0 + 0.2 * rng.standard_normal(shape)
            ).astype(np.float32)
            w.add_tensor(name if name.endswith(".bias") else name + ".weight", values)
            continue
        values = rng.standard_normal(shape) / np.sqrt(shape[1])
        if name == "token_embd":
            values = 0.5 * rng.standard_normal(shape)
        if family == "llama" and name.endswith(("attn_q", "attn_k")):
            values = _permute(values, HEADS if name.endswith("attn_q") else KV_HEADS)
        data, raw = _encode(values, qtypes.get(name, "F32"), rng)
        w.add_tensor(name + ".weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
