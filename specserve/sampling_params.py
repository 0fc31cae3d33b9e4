"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from array import array
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16  # choices per request (each one is an engine request)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
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
    # logits processing (layers/logits_processor.py); the neutral values cost nothing
    presence_penalty: float = 0.0  # [-2, 2], OpenAI: over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: over generated tokens
    repetition_penalty: float = 1.0  # (0, 2], HF/vLLM: over prompt + generated tokens
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings held off until this many are out
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    # log-probs of each emitted token plus its `logprobs` most likely alternatives (raw
    # model distribution, before any sampling transform); None = none
    logprobs: int | None = None
    # the same for every prompt token after the first (its log-prob given the ones before);
    # such a request computes its whole prompt (no prefix-cache hit)
    prompt_logprobs: int | None = None
    # independent choices per prompt (LLM.generate and the server run one engine request per
    # choice; choice i > 0 of a seeded request gets the seed choice_seed(seed, i))
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: one sequence (n = 1),
        the request's seed for choice 0 and a seed derived from (seed, index) for the
        others (unseeded choices draw independently anyway)."""
        seed = self.seed if index == 0 or self.seed is None else choice_seed(self.seed, index)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        """Any penalty that reads the request's tokens."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Any logits processing beyond the sampling transform (penalties, min_tokens,
        logit_bias): such rows take the eager path."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)

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
        if not 1 <= integer("n", self.n) <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= num(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < num("repetition_penalty", self.repetition_penalty) <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got "
                             f"{self.repetition_penalty}")
        if not 0 <= integer("min_tokens", self.min_tokens) <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if integer("logit_bias", t) < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {t}")
            if not -100.0 <= num("logit_bias", b) <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and integer(name, k) < 0:
                raise ValueError(f"{name} must be >= 0, got {k}")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` (> 0) of a request seeded `seed`: distinct per choice,
    the same for the same (seed, index)."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
