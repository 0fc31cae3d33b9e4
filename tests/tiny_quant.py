"""Tiny quantized checkpoints (Llama, DeepSeek-V3) in the formats of quant_formats.py
(quantized with plain torch, no quantization library).

The reference model is transformers' model with the dequantized weights (and, for W8A8
formats, its linear inputs fake-quantized the way the format quantizes activations).
DeepSeek-V3: the MLA projections, dense MLPs and shared experts are quantized, and the routed
experts too, or not, or alone (EXPERT_SPLITS; the config's ignore list says which); kv_b_proj's
input is never quantized (the engine dequantizes that weight at load and reads it as W_UK /
W_UV). W8A8 routed experts make the reference's expert loop fake-quantize both GEMMs' inputs.
"""

from __future__ import annotations

import json
import os

import torch
from quant_formats import LINEARS, _fake_quant_groups, _tensors, activation_quant, quant_config
from safetensors.torch import save_file
from tiny_models import DEEPSEEK_TINY, make_hf_model
from tiny_tokenizer import make_tiny_tokenizer

# head_dim 64: q/k/v shards (256/128/128) and gate/up (384) fall on 128-row blocks
SHAPE = dict(
    hidden_size=256,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=256,
)

SHARD_OF = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


def _per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' stacked expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I])
    as {checkpoint module name (`...experts.E.gate_proj`): its [out, in] matrix}."""
    prefix, _, kind = name.rpartition(".")
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj": t for e, t in enumerate(tensor)}
    inter = tensor.shape[1] // 2
    return {
        f"{prefix}.{e}.{part}_proj": t[i * inter : (i + 1) * inter]
        for e, t in enumerate(tensor)
        for i, part in enumerate(("gate", "up"))
    }


def _w8a8_experts_forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
    """transformers' expert loop with both GEMMs' inputs fake-quantized (W8A8 experts)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        tok, pos = torch.where(top_k_index == e)
        if len(tok):
            x = _fake_quant_groups(hidden_states[tok], 128)
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = _fake_quant_groups(self.act_fn(gate) * up, 128)
            y = torch.nn.functional.linear(h, self.down_proj[e])
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    return out


# which linears a DeepSeek-V3 checkpoint quantizes (`experts=`): all but the routed experts,
# all of them, or only the routed experts (Kimi K2.5's INT4 split, and its NVFP4 releases')
EXPERT_SPLITS = ("dense", "quantized", "only")
ONLY_FORMATS = ("fp8-block", "ct-int4-g32", "modelopt-nvfp4", "ct-nvfp4")
KIMI_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]  # fmt: skip
# the same modules as ModelOpt wildcards (the dense MLP of layer 0 by its projections' names)
KIMI_EXCLUDE = ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate_proj",
                "*mlp.up_proj", "*mlp.down_proj"]  # fmt: skip


def make_quantized_checkpoint(
    path: str | os.PathLike, fmt: str, seed: int = 0, family: str = "llama",
    experts: str = "dense", **overrides: object,
) -> torch.nn.Module:  # fmt: skip
    """Write a tiny `family` model (llama | deepseek_v3) in `fmt` at `path`; return the fp32
    reference transformers model. `experts`: see EXPERT_SPLITS (DeepSeek-V3)."""
    assert experts in EXPERT_SPLITS and (experts != "only" or fmt in ONLY_FORMATS)
    path = os.fspath(path)
    shape = SHAPE if family == "llama" else DEEPSEEK_TINY
    model = make_hf_model(family, seed, **{**shape, **overrides})
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    stacked = sorted({n.rsplit(".", 1)[0] for n in state if ".mlp.experts." in n})
    dense_linears = []  # modules left dense with experts="only"
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        part = module.rsplit(".", 1)[-1]
        if module in stacked:  # routed experts: per-expert names
            deq = []
            for expert, matrix in _per_expert(name, tensor).items():
                if experts == "dense":
                    out[f"{expert}.weight"] = matrix.contiguous()
                    continue
                tensors, d = _tensors(fmt, matrix, 0)
                out.update({f"{expert}.{sfx}": t.contiguous() for sfx, t in tensors.items()})
                deq.append(d)
            if deq:  # back to transformers' stacked layout: [E, 2I, H] (gate | up) or [E, H, I]
                parts = 1 if leaf == "down_proj" else 2
                state[name] = torch.stack(
                    [torch.cat(deq[e * parts : (e + 1) * parts]) for e in range(len(tensor))]
                )
            continue
        if part not in LINEARS or leaf != "weight" or experts == "only":
            out[name] = tensor
            if part in LINEARS and leaf == "weight":
                dense_linears.append(module)
            continue
        tensors, deq = _tensors(fmt, tensor, SHARD_OF.get(part, 0))
        out.update({f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
        state[name] = deq
    model.load_state_dict(state)
    for name, mod in model.named_modules():
        quant = activation_quant(fmt, name)
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS and quant:
            mod.register_forward_pre_hook(lambda m, args, q=quant: (q(args[0]),))
        if name in stacked and experts != "dense" and fmt in ("fp8-block", "ct-fp8-block"):
            mod.forward = _w8a8_experts_forward.__get__(mod)
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"))
    config = model.config.to_dict()
    dense_experts = stacked if experts == "dense" else None
    if fmt == "modelopt-nvfp4":  # the legacy ModelOpt layout: a file beside config.json
        with open(os.path.join(path, "hf_quant_config.json"), "w") as fh:
            json.dump(
                {
                    "producer": {"name": "modelopt", "version": "0.29.0"},
                    "quantization": {
                        "quant_algo": "NVFP4",
                        "kv_cache_quant_algo": None,
                        "group_size": 16,
                        "exclude_modules": (
                            KIMI_EXCLUDE
                            if experts == "only"
                            else ["lm_head"] + (["*.experts.*"] if dense_experts else [])
                        ),
                    },
                },
                fh,
            )
    else:
        config["quantization_config"] = quant_config(fmt, dense_experts)
        if experts == "only" and fmt == "fp8-block":
            config["quantization_config"]["ignored_layers"] = dense_linears
        elif experts == "only":
            config["quantization_config"]["ignore"] = list(KIMI_IGNORE)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    make_tiny_tokenizer(path, vocab_size=config["vocab_size"])
    return model


def logit_errors(
    model: torch.nn.Module, reference: torch.nn.Module, seed: int, lengths: tuple = (13, 6),
    vocab: int = 512,
) -> list[float]:  # fmt: skip
    """Sorted per-row max |logit difference| between `model` (a batched prefill of prompts of
    `lengths` over a paged cache, then 3 decodes) and `reference` on the same tokens."""
    import random

    from engine_drivers import PagedSession

    rng = random.Random(seed)
    tokens = {r: [rng.randrange(vocab) for _ in range(n)] for r, n in enumerate(lengths)}
    session = PagedSession(model)
    got = {r: [t] for r, t in zip(tokens, session.step(tokens))}
    for _ in range(3):
        nxt = {r: [rng.randrange(vocab)] for r in tokens}
        for r, logits in zip(nxt, session.step(nxt)):
            got[r].append(logits)
            tokens[r] += nxt[r]
    errors = []
    with torch.no_grad():
        for r, ids in tokens.items():
            ref = reference(torch.tensor([ids])).logits[0]
            # the format is not lossless: a dense model would be visibly off
            assert ref.abs().max() > 1.0
            errors += (torch.cat(got[r]) - ref).abs().amax(-1).tolist()
    return sorted(errors)
