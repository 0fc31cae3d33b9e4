"""MTP on an FP8 checkpoint (tests/tiny_mtp.py's DeepSeek-V3 with its projections in block
FP8, as DeepSeek-V3 ships): the MTP layer takes the target's quantization, drafts as the
reference MTP math on the dequantized weights with W8A8's activation quantization, and greedy
MTP speculation equals plain decoding."""

from __future__ import annotations

import pytest
import torch
from tiny_mtp import make_mtp_checkpoint, reference_chain

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


@pytest.mark.slow
def test_fp8_mtp_layer_drafts_as_its_dequantized_reference(tmp_path) -> None:
    """DeepSeek-V3 as it ships: every projection of the target and of the MTP block (its MLA
    attention, routed and shared experts) in 128x128 block FP8 (W8A8), eh_proj, norms,
    router, embeddings and heads dense. The MTP layer loads its FP8 tensors with the
    target's quantization; its chained draft logits over a request's cycles equal the
    reference MTP math on the dequantized weights with the activations fake-quantized as
    W8A8 does (tests/quant_formats.py; the W8A8 tolerances of test_quantization), and greedy
    MTP speculation equals plain decoding."""
    import json
    import os
    import shutil

    from quant_formats import LINEARS, _tensors, activation_quant, quant_config
    from safetensors.torch import load_file, save_file
    from tiny_mtp import PREFIX, _hf_target
    from tiny_quant import _w8a8_experts_forward

    # moe_intermediate_size 128: the fused gate/up shards end on 128-row blocks
    src, hf4 = make_mtp_checkpoint(str(tmp_path / "bf16"), "deepseek_v3",
                                   moe_intermediate_size=128)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] in LINEARS and leaf == "weight":
            codes, d = _tensors("fp8-block", t, 0)
            fp8.update({f"{module}.{sfx}": v.contiguous() for sfx, v in codes.items()})
            deq[name] = d.contiguous()
        else:
            fp8[name] = deq[name] = t
    assert "model.layers.3.mlp.experts.0.up_proj.weight_scale_inv" in fp8
    assert "model.layers.3.eh_proj.weight" in fp8  # dense, as DeepSeek-V3 ships it
    paths = {}
    for kind, state in (("fp8", fp8), ("deq", deq)):
        paths[kind] = str(tmp_path / kind)
        shutil.copytree(src, paths[kind])
        save_file(state, os.path.join(paths[kind], "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(paths["fp8"], "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = quant_config("fp8-block")
    with open(os.path.join(paths["fp8"], "config.json"), "w") as fh:
        json.dump(config, fh)
    # the reference: the dequantized target and MTP block, each linear's input fake-quantized
    block = hf4.model.layers[3]
    layer3 = {n[len(PREFIX):]: t for n, t in deq.items() if n.startswith(PREFIX)}
    own = block.state_dict()
    for name in own:
        if name in layer3:
            own[name] = layer3[name]
        elif name == "mlp.experts.gate_up_proj":  # transformers stacks experts: [E, 2I, H]
            own[name] = torch.stack([torch.cat([layer3[f"mlp.experts.{e}.{p}_proj.weight"]
                                                for p in ("gate", "up")])
                                     for e in range(len(own[name]))])  # fmt: skip
        elif name == "mlp.experts.down_proj":
            own[name] = torch.stack([layer3[f"mlp.experts.{e}.down_proj.weight"]
                                     for e in range(len(own[name]))])  # fmt: skip
    block.load_state_dict(own)
    for model in (_hf_target(paths["deq"]), block):
        for name, mod in model.named_modules():
            quant = activation_quant("fp8-block", name)
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS and quant:
                mod.register_forward_pre_hook(lambda m, args, q=quant: (q(args[0]),))
            if name.endswith("mlp.experts"):
                mod.forward = _w8a8_experts_forward.__get__(mod)

    k, prompt = 3, [5, 17, 99, 3, 250, 41, 7, 300, 12]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(paths["fp8"], device="cpu", dtype="float32").generate([prompt], params)
    seq = prompt + plain[0].token_ids
    llm = LLM(paths["fp8"], device="cpu", dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": k},
              enforce_eager=True)
    proposer = llm.engine.drafter.proposer
    methods = {type(m.quant_method).__name__ for m in proposer.head.modules()
               if hasattr(m, "quant_method")}
    assert {"Fp8LinearMethod", "Fp8BlockMoEMethod"} <= methods, methods
    cycles: list[tuple[int, list[torch.Tensor]]] = []
    propose, logits_of = proposer.propose, proposer.head.compute_logits

    def spy_propose(shape, state, root_pos, *args):
        cycles.append((int(root_pos[0]), []))
        return propose(shape, state, root_pos, *args)

    def spy_logits(out):
        logits = logits_of(out)
        cycles[-1][1].append(logits[0].clone())
        return logits

    proposer.propose, proposer.head.compute_logits = spy_propose, spy_logits
    out = llm.generate([prompt], params)
    assert out[0].token_ids == plain[0].token_ids
    assert len(cycles) >= 3
    errors = []
    for root, logits in cycles:
        want = reference_chain(paths["deq"], hf4, seq[: root + 1], k)
        for got, ref in zip(logits, want):
            errors.append((got - ref).abs().max().item())
            if got.argmax() != ref.argmax():  # a near-tie drafted another token: later steps
                break  # of this cycle continue from different inputs
    errors.sort()
    assert errors[len(errors) // 2] < 1e-4 and errors[-1] < 0.15, errors
