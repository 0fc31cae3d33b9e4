"""The quantized checkpoint formats in plain torch (no quantization library), for the tiny
checkpoints of tiny_quant.py and the kernel tests: each format turns a dense fp32 [N, K]
weight into the tensors its producer writes (the real names, dtypes and layouts) and into the
fp32 weight those tensors mean (FP8 128-block / per-channel / per-tensor, INT4 groups, NVFP4;
stacked experts); the quantization config each format's checkpoint declares; and the
activation fake-quantization of the W8A8 formats (what the reference applies to its linear
inputs; kv_b_proj's input is never quantized: the engine dequantizes that weight at load).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
LINEARS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
)  # fmt: skip
DENSE_INPUT = ("kv_b_proj",)  # dequantized at load: its input is never quantized
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _tiles(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros(pn, pk)
    padded[:n, :k] = w
    return padded.view(pn // bn, bn, pk // bk, bk)


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[dict, torch.Tensor]:
    t = _tiles(w, block, block)
    s = t.abs().amax(dim=(1, 3)) / 448.0  # [N/128, K/128]
    q = (t / s[:, None, :, None]).to(FP8)
    deq = (q.float() * s[:, None, :, None]).reshape(t.shape[0] * block, -1)
    n, k = w.shape
    q = q.reshape(t.shape[0] * block, -1)[:n, :k].contiguous()
    return {"weight": q, "scale": s}, deq[:n, :k]


def fp8_channel(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    s = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
    q = (w / s).to(FP8)
    return {"weight": q, "scale": s}, q.float() * s


def fp8_tensor(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    s = w.abs().max() / 448.0
    q = (w / s).to(FP8)
    return {"weight": q, "scale": s.reshape(())}, q.float() * s


def int4_group(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    groups = -(-k // group)
    padded = torch.zeros(n, groups * group)
    padded[:, :k] = w
    g = padded.view(n, groups, group)
    s = (g.abs().amax(-1) / 7.5).to(torch.bfloat16)  # stored bf16, as Kimi's checkpoints
    q = torch.round(g / s.float()[..., None]).clamp(-8, 7)
    deq = (q * s.float()[..., None]).view(n, -1)[:, :k]
    nib = (q.view(n, -1)[:, :k] + 8).to(torch.int64)
    words = -(-k // 8)
    nib = torch.cat([nib, torch.zeros(n, words * 8 - k, dtype=torch.int64)], 1).view(n, words, 8)
    packed = torch.zeros(n, words, dtype=torch.int64)
    for i in range(8):  # element 8c + i -> bits 4i of word c
        packed |= nib[:, :, i] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {
        "weight_packed": packed,
        "weight_scale": s,
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }, deq


def nvfp4(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    glob = w.abs().max() / (6.0 * 448.0)
    g = w.view(n, k // 16, 16)
    s = (g.abs().amax(-1) / 6.0 / glob).to(FP8)  # [N, K/16]
    scaled = g / (s.float() * glob)[..., None]
    idx = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest magnitude
    code = idx + 8 * (scaled < 0).long()
    deq = torch.where(scaled < 0, -E2M1[idx], E2M1[idx]) * (s.float() * glob)[..., None]
    code = code.view(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)  # low nibble = even
    return {"packed": packed, "weight_scale": s, "global": glob.reshape(())}, deq.view(n, k)


def quantize_experts(
    w: torch.Tensor, fmt: str, parts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked expert matrices [E, N, K] (`parts` row parts quantized apart: gate | up) in
    `fmt` (fp8-block | ct-int4-gG): (codes, scales, fp32 dequantized [E, N, K]), stacked the
    way the engine holds them (each part's scale rows after the previous part's)."""
    codes, scales, deqs = [], [], []
    for matrix in w:
        per_part = [_tensors(fmt, part, 0) for part in matrix.float().chunk(parts, dim=0)]
        code_key = "weight" if fmt == "fp8-block" else "weight_packed"
        scale_key = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
        codes.append(torch.cat([t[code_key] for t, _ in per_part]))
        scales.append(torch.cat([t[scale_key] for t, _ in per_part]))
        deqs.append(torch.cat([d for _, d in per_part]))
    return torch.stack(codes), torch.stack(scales), torch.stack(deqs)


def _tensors(fmt: str, w: torch.Tensor, shard: int) -> tuple[dict, torch.Tensor]:
    """The checkpoint tensors of one linear in `fmt` (suffix -> tensor) and its fp32 weight."""
    if fmt in ("fp8-block", "ct-fp8-block"):
        t, deq = fp8_block(w)
        return {
            "weight": t["weight"],
            ("weight_scale_inv" if fmt == "fp8-block" else "weight_scale"): t["scale"],
        }, deq
    if fmt == "ct-fp8-channel":
        t, deq = fp8_channel(w)
        return {"weight": t["weight"], "weight_scale": t["scale"]}, deq
    if fmt == "modelopt-fp8":
        t, deq = fp8_tensor(w)
        input_scale = torch.tensor(0.01 + 0.002 * shard)  # fused shards' scales differ
        return {"weight": t["weight"], "weight_scale": t["scale"], "input_scale": input_scale}, deq
    if fmt.startswith("ct-int4"):
        return int4_group(w, int(fmt.rsplit("g", 1)[1]))
    if fmt == "modelopt-nvfp4":
        t, deq = nvfp4(w)
        return {
            "weight": t["packed"],
            "weight_scale": t["weight_scale"],
            "weight_scale_2": t["global"],
            "input_scale": torch.tensor(0.5),
        }, deq
    if fmt == "ct-nvfp4":
        t, deq = nvfp4(w)
        return {
            "weight_packed": t["packed"],
            "weight_scale": t["weight_scale"],
            "weight_global_scale": 1.0 / t["global"],
            "input_global_scale": torch.tensor(2.0),
        }, deq
    raise ValueError(fmt)


def _ct_config(weights: dict, acts: dict | None, fmt: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
    }


def quant_config(fmt: str, dense_experts: list[str] | None = None) -> dict:
    """The checkpoint's quantization config; `dense_experts`: the routed-expert modules
    (`model.layers.L.mlp.experts`) left unquantized, added to the format's ignore list."""
    raw = _quant_config(fmt)
    if dense_experts:
        if fmt == "fp8-block":
            raw["ignored_layers"] = list(dense_experts)
        elif raw["quant_method"] == "compressed-tensors":
            raw["ignore"] = [*raw["ignore"], r"re:.*\.experts\..*"]
        else:
            raw["ignore"] = [*raw["ignore"], "*.experts.*"]
    return raw


def _quant_config(fmt: str) -> dict:
    fp8w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if fmt == "ct-fp8-block":
        return _ct_config(
            {**fp8w, "strategy": "block", "block_structure": [128, 128]},
            {
                "num_bits": 8,
                "type": "float",
                "strategy": "group",
                "group_size": 128,
                "dynamic": True,
                "symmetric": True,
            },
            "float-quantized",
        )
    if fmt == "ct-fp8-channel":
        return _ct_config(
            {**fp8w, "strategy": "channel"},
            {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
                "symmetric": True,
            },
            "float-quantized",
        )
    if fmt.startswith("ct-int4"):
        return _ct_config(
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": int(fmt.rsplit("g", 1)[1]),
                "actorder": None,
            },
            None,
            "pack-quantized",
        )
    if fmt == "ct-nvfp4":
        nv = {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor_group",
            "group_size": 16,
        }
        return _ct_config(nv, {**nv, "dynamic": "local"}, "nvfp4-pack-quantized")
    if fmt == "modelopt-fp8":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
    raise ValueError(fmt)


# activation fake-quantization of the W8A8 formats (applied to the reference's linear inputs)
def _fake_quant_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    out = torch.empty_like(flat)
    for start in range(0, k, group):
        part = flat[:, start : start + group]
        s = part.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
        out[:, start : start + group] = (part / s).to(FP8).float() * s
    return out.view(x.shape)


def activation_quant(fmt: str, module_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if module_name.endswith(DENSE_INPUT):
        return None
    if fmt in ("fp8-block", "ct-fp8-block"):
        return lambda x: _fake_quant_groups(x, 128)
    if fmt == "ct-fp8-channel":
        return lambda x: _fake_quant_groups(x, x.shape[-1])
    if fmt == "modelopt-fp8":  # fused shards share x: the largest of their static scales
        s = (
            0.014
            if module_name.endswith(("q_proj", "k_proj", "v_proj"))
            else (0.012 if module_name.endswith(("gate_proj", "up_proj")) else 0.01)
        )
        return lambda x: (x / s).clamp(-448, 448).to(FP8).float() * s
    return None
