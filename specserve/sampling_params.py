"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_STOP_TOKEN_IDS = 256
# temperatures below this (compared in float32, the sampler's precision) sample greedily:
# logits / T overflows float32 long before T reaches 0 (T = 1e-38 gives inf - inf = NaN)
GREEDY_BELOW = 1e-5


def as_float32(x: float) -> float:
    """The float32 value the device sees for x (inf past float32's range, 0 below it)."""
    return array("f", [x])[0]


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # per-request seed: same seed, same output
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        """Decided once, from the float32 temperature the sampler would divide by: the host
        (batch modes, graph choice) and the device (which sees 0 for these rows) agree."""
        return as_float32(self.temperature) < as_float32(GREEDY_BELOW)

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what to change."""
        def num(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            return value

        if num("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < num("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = integer("top_k", self.top_k)
        if top_k < -1 or top_k > 2**31 - 1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {top_k}")
        if not 0.0 <= num("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= integer("seed", self.seed) < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if integer("stop_token_ids[i]", t) < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
