"""Token sampling: per-request transforms (temperature, top-k, top-p, min-p) and seeded noise.

Randomness is counter-based: a splitmix64 hash of (seed, counter, index, salt) gives each
request its own stream without per-row generators and without host syncs, so a request samples
the same tokens whatever else shares its batch, on the CPU and on the GPU alike.

Every sampled token is one draw: the inverse CDF of the row's transformed distribution at the
uniform keyed by (seed, position of the token decided). Plain decoding, prefill and each node
of speculative verification use it alike, so a seeded request emits the same tokens whatever
decides them: preemption and re-prefill, where cycles start, speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specserve.sampling_params import GREEDY_BELOW, SamplingParams

SAMPLE_SALT = 0  # salt of the token draws (token_uniforms)
ACCEPT_SALT = 1  # a second stream (no engine draw uses it)
SYNTHETIC_RATE_SALT = 2  # a request's synthetic acceptance rate (cost-only benchmarks)
SYNTHETIC_DRAW_SALT = 3  # a cycle's synthetic acceptance draws

_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 value with the same bits."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits: torch shifts arithmetically, so clear the sign fill."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MUL1
    z = (z ^ _shift_right(z, 27)) * _MUL2
    return z ^ _shift_right(z, 31)


def uniform_noise(
    seeds: torch.Tensor, counters: torch.Tensor, num: int, salt: int = 0
) -> torch.Tensor:
    """Uniforms in (0, 1) from (seed, counter, index, salt); [n] x [n] -> [n, num] float32.

    Row r is the splitmix64 stream keyed by mix(mix(seed + (salt + 1) * G) ^ counter): element i
    is mix(key + (i + 1) * G). The top 23 bits become (k + 0.5) / 2**23, exact in float32, so the
    values never reach 0 or 1.
    """
    assert seeds.shape == counters.shape and seeds.dim() == 1
    key = _mix(seeds.long() + _signed((salt + 1) * _GOLDEN))  # [n]
    key = _mix(key ^ counters.long())  # [n]
    steps = torch.arange(1, num + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN  # [num]
    bits = _shift_right(_mix(key[:, None] + steps[None, :]), 41)  # [n, num], 23 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


GRAPH_FIELDS = ("temperatures", "top_ks", "top_ps", "min_ps", "seeds")


def host_fields(temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                min_p: Sequence[float], seeds: Sequence[int],
                vocab_size: int) -> dict[str, np.ndarray]:
    """The per-row sampling fields as host arrays (no counters), named as a captured graph's
    static inputs. Top-k off (<= 0) or past the vocabulary becomes vocab_size; a temperature
    under GREEDY_BELOW (compared in float32, as SamplingParams.greedy) becomes 0, the greedy
    marker every later check reads."""
    top_k = np.asarray(top_k, dtype=np.int64)
    temps = np.asarray(temperature, dtype=np.float32)
    return {
        "temperatures": np.where(temps < np.float32(GREEDY_BELOW), np.float32(0), temps),
        "top_ks": np.where(top_k <= 0, vocab_size, np.minimum(top_k, vocab_size)),
        "top_ps": np.asarray(top_p, dtype=np.float32),
        "min_ps": np.asarray(min_p, dtype=np.float32),
        "seeds": np.asarray(seeds, dtype=np.int64),
    }


def graph_sampling_inputs(max_bs: int, vocab_size: int, device: torch.device
                          ) -> tuple[dict[str, torch.Tensor], dict[str, int | float]]:
    """Static input buffers (and pads) of the sampling fields, for BatchGraphs."""
    f32, i64 = torch.float32, torch.int64
    inputs = {name: torch.zeros(max_bs, dtype=f32 if name in ("temperatures", "top_ps",
                                                               "min_ps") else i64, device=device)
              for name in GRAPH_FIELDS}
    pads = {"temperatures": 0.0, "top_ks": vocab_size, "top_ps": 1.0, "min_ps": 0.0, "seeds": 0}
    return inputs, pads


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host flags that skip unneeded work."""

    temperatures: torch.Tensor  # [bs] float32, 0 = greedy
    top_ks: torch.Tensor  # [bs] int64, vocab_size when off
    top_ps: torch.Tensor  # [bs] float32, 1 when off
    min_ps: torch.Tensor  # [bs] float32, 0 when off
    seeds: torch.Tensor  # [bs] int64
    counters: torch.Tensor  # [bs] int64, position of the token being decided
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool  # flags look at sampled (non-greedy) rows only
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        counters: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """From per-request SamplingParams (see from_fields)."""
        fields = host_fields([p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [p.min_p for p in params], seeds,
                             vocab_size)
        return cls.from_fields(fields, counters, vocab_size, device)

    @classmethod
    def from_fields(
        cls,
        fields: dict[str, np.ndarray],
        counters: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """host_fields' arrays plus counters: every field packed into one host buffer and
        copied to the device once."""
        temps = fields["temperatures"]
        bs = len(temps)
        assert bs and len(counters) == bs
        ints = np.stack([fields["top_ks"], fields["seeds"],
                         np.asarray(counters, dtype=np.int64)]).astype(np.int64)  # [3, bs]
        floats = np.stack([temps, fields["top_ps"], fields["min_ps"]]).astype(np.float32)
        # int64 block first keeps the float32 block 4-byte aligned inside the byte buffer
        host = torch.from_numpy(np.concatenate([ints.reshape(-1).view(np.uint8),
                                                floats.reshape(-1).view(np.uint8)]))
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        ints_d = dev[: 24 * bs].view(torch.int64).view(3, bs)
        floats_d = dev[24 * bs :].view(torch.float32).view(3, bs)
        sampled = temps != 0.0  # flags look at sampled (non-greedy) rows only
        return cls(
            temperatures=floats_d[0],
            top_ks=ints_d[0],
            top_ps=floats_d[1],
            min_ps=floats_d[2],
            seeds=ints_d[1],
            counters=ints_d[2],
            all_greedy=not sampled.any(),
            any_greedy=not sampled.all(),
            any_top_k=bool((fields["top_ks"][sampled] < vocab_size).any()),
            any_top_p=bool((fields["top_ps"][sampled] < 1.0).any()),
            any_min_p=bool((fields["min_ps"][sampled] > 0.0).any()),
        )

    @classmethod
    def general(cls, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                min_ps: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor
                ) -> SamplingTensors:
        """Every transform on: the path that is right for any mix of parameters (what a
        captured graph runs, since host flags cannot change between its replays)."""
        return cls(temperatures, top_ks, top_ps, min_ps, seeds, counters, all_greedy=False,
                   any_greedy=True, any_top_k=True, any_top_p=True, any_min_p=True)

    def repeat_interleave(self, n: int) -> SamplingTensors:
        """Each row repeated n times (verify: one row per tree node); flags unchanged."""
        rep = {
            name: getattr(self, name).repeat_interleave(n, dim=0)
            for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "counters")
        }
        return replace(self, **rep)


def _apply_top_k_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, then outside the top-p nucleus of what is left.

    One descending sort serves both. Top-p keeps a token iff the mass of the tokens ranked above
    it is < top_p (the smallest prefix reaching top_p), and always keeps rank 0.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [bs, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    if st.any_top_k:
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= st.top_ks[:, None], -torch.inf)
    if st.any_top_p:
        p = sorted_logits.softmax(dim=-1)  # [bs, V]
        mass_above = p.cumsum(dim=-1) - p  # [bs, V] exclusive prefix mass
        top_ps = st.top_ps[:, None]
        drop = (mass_above >= top_ps) & (top_ps < 1.0) & (ranks[None, :] > 0)
        sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[bs, V] logits -> [bs, V] float32 probabilities after the row's sampling transform.

    Order: temperature, top-k, top-p, min-p (min-p keeps p >= min_p * max p), then
    renormalise; the most likely token always survives. Greedy rows give the one-hot of the
    argmax, so verification treats greedy and sampled rows by one rule.
    """
    logits = logits.float()
    greedy = st.temperatures == 0.0  # [bs]
    if st.all_greedy:
        return _one_hot_argmax(logits)
    temps = torch.where(greedy, torch.ones_like(st.temperatures), st.temperatures)
    scaled = logits / temps[:, None]  # [bs, V]
    if st.any_top_k or st.any_top_p:
        scaled = _apply_top_k_top_p(scaled, st)
    probs = scaled.softmax(dim=-1)  # [bs, V]
    if st.any_min_p:
        keep = probs >= st.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if st.any_greedy:
        probs = torch.where(greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[bs, V] -> [bs, V] float32 one-hot of the row argmax (first maximum on ties)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def token_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[bs] seeds, [bs, m] positions -> [bs, m] uniforms in (0, 1): the draw that decides the
    token at each position (verification passes every tree node's; nodes of one depth share
    one, which is sound since the walk visits one node per depth)."""
    bs, m = positions.shape
    flat = uniform_noise(seeds[:, None].expand(bs, m).reshape(-1), positions.reshape(-1), 1,
                         SAMPLE_SALT)
    return flat.view(bs, m)


def sample_per_node(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: [..., V] probs and [...] uniforms in (0, 1) -> [...] int64 tokens.

    Picks the first token whose cumulative mass exceeds u * total; that token has p > 0, and a
    one-hot row always gives its hot index.
    """
    cdf = probs.float().cumsum(dim=-1)  # [..., V]
    target = (uniforms.float() * cdf[..., -1])[..., None]  # [..., 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


class Sampler:
    """Greedy and sampled rows in one call; the result stays on the device (no host sync)."""

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """[bs, V] logits -> [bs] int64 tokens: the draw at the uniform of (seed, counter);
        greedy rows have one-hot probs, so the draw returns their argmax."""
        if st.all_greedy:
            return logits.argmax(dim=-1)
        probs = probs_from_logits(logits, st)  # [bs, V]
        return sample_per_node(probs, token_uniforms(st.seeds, st.counters[:, None])[:, 0])

    __call__ = sample
