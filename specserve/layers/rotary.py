"""Rotary position embedding (RoPE), rotate-half layout, with the common context extensions.

For rotary dims r and position p, pair i < r/2 rotates (x[i], x[i + r/2]) by angle
p * inv_freq[i], inv_freq[i] = base^(-2i/r):
    out[i]       = x[i] * cos - x[i + r/2] * sin
    out[i + r/2] = x[i + r/2] * cos + x[i] * sin
r is the head_dim, or a part of it (partial rotary, GLM-4.5: r = head_dim / 2): dims [r,
head_dim) pass through unchanged. Scaling types change inv_freq (and, for yarn, scale cos/sin
by an attention factor).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.kernels.dispatch import use_triton
from specserve.kernels.rotary import rotary_inplace
from specserve.layers import attention_metadata

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # inv_freq[i] = base^(-2i/d), i < d/2; fp32 like the reference implementation
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 rule: long wavelengths divided by `factor`, short ones kept, a smooth blend
    in between (wavelengths measured against the original context length)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor for a context scaled `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    head_dim: int, base: float, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate (divide by factor) the low frequencies, keep the high ones, ramp
    between the dims that rotate beta_slow..beta_fast times over the original context."""
    old_len = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / old_len
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                       else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency, 0: fully interpolated
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attn_factor)


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, attention factor applied to cos/sin)."""
    kind = "default" if rope_scaling is None else rope_scaling.get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(head_dim, base), 1.0
    if kind == "linear":
        return _base_inv_freq(head_dim, base) / rope_scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, base), rope_scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling, max_position)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported types: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]; cos, sin [T, r / 2]: the first r dims rotate, the rest pass
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin cached per position (fp32) up to `max_position`; positions are never clamped.
    `rotary_dim` (default head_dim): the dims that rotate, the first of each head.

    The cache grows from host ints only (no device sync): in every forward, to the current
    attention metadata's max_seq_len (every position of a forward is below it). CUDA graphs
    replay without running Python, so grow it before capture: `ensure_rope_capacity(model,
    max_model_len)`.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary dims must be even and in (0, head_dim = {head_dim}], got {rotary_dim}: "
                "check partial_rotary_factor"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq, self.attention_factor = compute_inv_freq(
            rotary_dim, base, rope_scaling, max_position
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # [num_positions, rotary_dim]: cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", self._build(max_position), persistent=False)

    def _build(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq.float())  # [num_positions, head_dim / 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor

    fixed = False  # set by ensure_rope_capacity: the table CUDA graphs read stays as it is

    def ensure_capacity(self, num_positions: int) -> None:
        """Make positions [0, num_positions) valid (grows by doubling; host-only check). Once
        fixed, a forward past the table is an error, not a new table that captured graphs
        would never see (they would replay over the freed old one)."""
        size = self.cos_sin_cache.shape[0]
        if num_positions > size:
            if self.fixed:
                raise RuntimeError(
                    f"a forward reaches position {num_positions - 1}, past the RoPE table's "
                    f"{size} positions (fixed before CUDA graph capture at max_model_len + "
                    "256): rows must stay within the runner's max_positions")
            self.cos_sin_cache = self._build(max(num_positions, 2 * size))

    def table(self) -> torch.Tensor:
        """The cos/sin table, grown to the current forward's positions."""
        ctx = attention_metadata._CONTEXT  # None outside a forward
        if ctx is not None and ctx.metadata is not None:
            self.ensure_capacity(ctx.metadata.max_seq_len)
        return self.cos_sin_cache

    @staticmethod
    def fusable(q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the Triton kernels can rotate these tensors in place."""
        return use_triton(q, k) and q.stride(-1) == 1 and k.stride(-1) == 1

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]
        self.table()
        if self.fusable(q, k):
            rotary_inplace(positions, q, k, self.cos_sin_cache)  # one launch for q and k
            return q, k
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def ensure_rope_capacity(model: nn.Module, num_positions: int) -> None:
    """Grow every RoPE cache in `model` to cover positions [0, num_positions), then fix it
    there (graphs captured after this read that table: it must never be replaced)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.fixed = False
            module.ensure_capacity(num_positions)
            module.fixed = True
