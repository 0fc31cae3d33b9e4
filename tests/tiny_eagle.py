"""Write tiny random EAGLE-3 heads in the public checkpoint formats (for tests)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from specserve.speculative.tree import TreeAccumulator

if TYPE_CHECKING:
    from specserve.llm import LLM


def make_tiny_eagle3_head(path: str, target_dir: str, draft_vocab_size: int | None = 64,
                          layout: str = "official", seed: int = 0, scale: float = 0.5,
                          with_embed: bool = False, fc_bias: bool = False,
                          use_bin: bool = False) -> str:
    """A random head for the target at `target_dir`.

    layout "official": `midlayer.*`, `d2t` offsets, `t2d`; "layers0": the speculators variant
    (`layers.0.*`). draft_vocab_size None: no lm_head / d2t (the target's lm_head is used).
    The draft vocabulary is every other target id starting at 1 (so d2t[i] = i + 1).
    """
    with open(os.path.join(target_dir, "config.json")) as fh:
        tcfg = json.load(fh)
    h = tcfg["hidden_size"]
    heads = tcfg["num_attention_heads"]
    kv_heads = tcfg.get("num_key_value_heads", heads)
    hd = tcfg.get("head_dim") or h // heads
    inter = tcfg["intermediate_size"]
    vocab = tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5).contiguous()

    prefix = "midlayer." if layout == "official" else "layers.0."
    w = {
        "fc.weight": rnd(h, 3 * h),
        prefix + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        prefix + "self_attn.k_proj.weight": rnd(kv_heads * hd, 2 * h),
        prefix + "self_attn.v_proj.weight": rnd(kv_heads * hd, 2 * h),
        prefix + "self_attn.o_proj.weight": rnd(h, heads * hd),
        prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        prefix + "mlp.gate_proj.weight": rnd(inter, h),
        prefix + "mlp.up_proj.weight": rnd(inter, h),
        prefix + "mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
    }
    if fc_bias:
        w["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    if with_embed:
        w["embed_tokens.weight"] = torch.randn(vocab, h, generator=g)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if layout != "official" else "LlamaForCausalLM"],
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "num_hidden_layers": 1,
        "vocab_size": vocab, "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
        "torch_dtype": "float32",
    }
    if draft_vocab_size is not None:
        ids = torch.arange(draft_vocab_size) * 2 + 1  # draft id i <-> target id 2i + 1
        assert ids[-1] < vocab
        w["lm_head.weight"] = rnd(draft_vocab_size, h)
        w["d2t"] = ids - torch.arange(draft_vocab_size)
        w["t2d"] = torch.isin(torch.arange(vocab), ids)
        cfg["draft_vocab_size"] = draft_vocab_size
    os.makedirs(path, exist_ok=True)
    if use_bin:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


def oracle_propose(llm: LLM, reference: dict, decoys: bool):
    """A drafter that knows the target's greedy continuation. With decoys, the true depth-1
    token gets a sibling scored above it (whose subtree is kept too), so the accepted path's
    nodes are not at slots 1, 2, ... and its KV must be compacted into place."""
    drafter = llm.engine.drafter
    k, steps = drafter.k, drafter.num_steps
    device = drafter.runner.device

    def truth(req, root: int, depth: int) -> int:
        full = list(req.prompt_token_ids) + reference[tuple(req.prompt_token_ids)]
        pos = root + depth
        return full[pos] if pos < len(full) else 0

    def logp_and_ids(true_ids: list[int], decoy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # [bs, k]: the true token first, or second behind a better-scored decoy
        rows_lp, rows_id = [], []
        for t in true_ids:
            ids = [t] + [(t + 7 * (j + 1)) % 500 for j in range(k - 1)]
            lp = [0.0] + [-2.0 - j for j in range(k - 1)]
            if decoy and k > 1:
                ids[0], ids[1] = ids[1], ids[0]
                lp[0], lp[1] = -0.1, -0.2
            rows_id.append(ids)
            rows_lp.append(lp)
        return torch.tensor(rows_lp, device=device), torch.tensor(rows_id, device=device)

    stash: list = []
    speculate = drafter.cycles.speculate

    def spy(rows, *args, **kw):
        stash[:] = [rows]
        return speculate(rows, *args, **kw)

    drafter.cycles.speculate = spy

    def propose(shape, state, root_pos, root_tokens, page_table, valid):
        reqs = [llm.engine.get_request(rid) for rid in stash[0].request_ids]
        roots = stash[0].starts.tolist()
        lp, ids = logp_and_ids([truth(r, p, 1) for r, p in zip(reqs, roots)], decoys)
        acc = TreeAccumulator(lp, ids, None)
        for s in range(1, steps):
            # children of every frontier slot: the true next token only matters on the true path
            child_lp, child_ids = [], []
            for r, p in zip(reqs, roots):
                lp_b, id_b = logp_and_ids([truth(r, p, s + 1)] * k, False)
                child_lp.append(lp_b)
                child_ids.append(id_b)
            acc.extend(torch.stack(child_lp), torch.stack(child_ids))
        return acc.build(root_tokens, drafter.n)

    return propose


def make_tiny_pair(root, max_position_embeddings: int = 256) -> tuple[str, str]:
    """A tiny llama target (4 layers, with a tokenizer) and a random EAGLE-3 head for it
    (a 128-token draft vocabulary), under the directory `root`."""
    try:
        from tiny_models import make_tiny_checkpoint
    except ImportError:
        from tests.tiny_models import make_tiny_checkpoint
    target = make_tiny_checkpoint(os.path.join(root, "target"), family="llama", tokenizer=True,
                                  num_hidden_layers=4,
                                  max_position_embeddings=max_position_embeddings)
    return target, make_tiny_eagle3_head(os.path.join(root, "head"), target, draft_vocab_size=128)
