"""Speculative decoding: the methods the engine knows, and their config.

`SpecConfig` is what the engine reads. `speculative_config(...)` builds one from vLLM's
`--speculative-config` / `speculative_config=` shape ({"method", "model",
"num_speculative_tokens", ...}) or from this engine's own field names, refusing unknown keys
and methods not implemented yet. A new method (mtp, ...) plugs in by turning its `SpecMethod`
entry `implemented` and giving the engine its drafter (speculative/methods.py); its own keys
join `KEYS` (and `METHOD_KEYS`, which refuses them for other methods).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from specserve.config_flags import ConfigError, check_fields, option
from specserve.spec_modes import (  # noqa: F401 (re-exported)
    EXTRA_METHODS,
    check_mode,
    full_mode_name,
    max_tree_nodes,
    mode_name,
    parse_mode,
    split_mode,
)


@dataclass(frozen=True)
class SpecMethod:
    name: str
    implemented: bool
    draft: str  # what `model` names for it ("" when it needs none)


METHODS: dict[str, SpecMethod] = {
    m.name: m
    for m in (
        SpecMethod("eagle3", True, "an EAGLE-3 head directory ('dummy': a random head)"),
        SpecMethod("eagle", False, "an EAGLE-1/2 head"),
        SpecMethod("draft_model", False, "a small model of the target's vocabulary"),
        SpecMethod("medusa", False, "Medusa heads"),
        SpecMethod("mtp", True, ""),  # the target's own MTP / NextN layer (no draft model)
        SpecMethod("ngram", True, ""),
        SpecMethod("suffix", True, ""),
    )
}
IMPLEMENTED = tuple(name for name, m in METHODS.items() if m.implemented)
PROFILE_BUDGET = 10.0  # seconds of the adaptive policy's start-up cost table, by default


@dataclass(frozen=True)
class SpecConfig:
    CLI_PREFIX: ClassVar[str] = "spec"

    algorithm: str = option(
        "none", "speculative decoding method: none | " + " | ".join(IMPLEMENTED), metavar="METHOD"
    )
    draft_model: str = option(
        "",
        "EAGLE-3 draft head directory or cached repo id ('dummy': a random head); given "
        "without --spec-algorithm it turns EAGLE-3 on",
        metavar="PATH",
    )
    num_steps: int = option(
        3, "draft forwards per cycle (tree depth; vLLM's num_speculative_tokens)", min=1
    )
    topk: int = option(1, "branching factor: 1 = chain, >1 = EAGLE-2 dynamic tree", min=1)
    num_draft_tokens: int = option(
        0, "tokens verified per cycle incl. the root (0 = num_steps+1)", min=0
    )
    synthetic_accept_len: int = option(
        0, "COST-ONLY benchmarking: force this accept length (0 = real verification)", min=0
    )
    aux_layer_convention: str = option(
        "auto",
        "what the head's eagle_aux_hidden_state_layer_ids mean (engines disagree by one): input "
        "= the residual stream entering decoder layer i (transformers' hidden_states[i]); "
        "output = leaving layer i (SpecForge-style exports: +1 here); auto = the head config's "
        "eagle_config.aux_layer_convention, else input",
        choices=("auto", "input", "output"),
    )
    synthetic_accept_rate: float = option(
        0.0,
        "COST-ONLY benchmarking: random acceptance instead of verification; each request draws "
        "its own per-draft acceptance rate uniformly around this mean (as wide as [0, 1] "
        "allows) and each cycle draws where its drafts are rejected (0 = off)",
        min=0.0,
        max=0.99,
    )
    policy: str = option(
        "static",
        "when to speculate: static (every step, the configured shape) | adaptive (per step, "
        "the mode of best expected tokens/s from a start-up cost table and per-request "
        "acceptance, off included)",
        choices=("static", "adaptive"),
        flags=("--spec-policy", "--speculative-policy"),
    )
    profile_budget: float | None = option(
        None, "adaptive policy: seconds its start-up cost table may take; batch sizes past it "
        "are extrapolated from the smaller ones timed (the two smallest always are) and mixed "
        "steps not timed are left to the policy's priors (0 = no limit)", min=0.0,
        metavar="SECONDS", help_default=f"{PROFILE_BUDGET:g} with the adaptive policy")
    prompt_lookup_max: int | None = option(
        None, "ngram: longest n-gram of the context's end looked up in the prompt + output "
        "(vLLM's name)", min=1, help_default="4 with method ngram")
    prompt_lookup_min: int | None = option(
        None, "ngram: shortest n-gram tried when no longer one matches", min=1,
        help_default="1 with method ngram")
    suffix_max_match_len: int | None = option(
        None, "suffix: longest context suffix matched against the request's tokens and the "
        "cached outputs (host work per token indexed grows with it)", min=1,
        help_default="8 with method suffix")
    suffix_max_cached_requests: int | None = option(
        None, "suffix: finished requests whose outputs the global structure keeps (LRU; 0 = "
        "no global structure; vLLM's suffix_decoding_max_cached_requests)", min=0,
        help_default="1000 with method suffix")
    suffix_min_token_prob: float | None = option(
        None, "suffix: a node is drafted only when the share of matched occurrences that "
        "continue with its path is at least this (vLLM's suffix_decoding_min_token_prob)",
        min=0.0, max=1.0, help_default="0.1 with method suffix")
    modes: str = option(
        "",
        "draft modes the adaptive policy may choose besides the configured one, e.g. "
        "'chain1,chain2,tree4x3x8' (chainS: S steps; treeKxSxN: top-k K, S steps, N tokens "
        "verified); each gets its own CUDA graphs",
        metavar="MODES",
        help_default="none",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.synthetic_accept_len and self.synthetic_accept_rate:
            raise ConfigError(SpecConfig, "synthetic_accept_rate",
                              "and synthetic_accept_len are both set; give one")
        method = METHODS.get(self.algorithm)
        if self.algorithm != "none" and method is None:
            raise ConfigError(
                SpecConfig,
                "algorithm",
                f"{self.algorithm!r} is not a "
                f"speculative method; known: none, {', '.join(METHODS)}",
            )
        if method is not None and not method.implemented:
            raise ConfigError(
                SpecConfig,
                "algorithm",
                f"{self.algorithm!r} is not implemented yet; implemented: {', '.join(IMPLEMENTED)}",
            )
        implemented = {name: m.implemented for name, m in METHODS.items()}
        for name in self.mode_names:
            try:
                check_mode(name, self.algorithm, implemented)
            except ValueError as exc:
                raise ConfigError(SpecConfig, "modes", str(exc)) from None
        most = max_tree_nodes(self.num_steps, self.topk)
        if not 2 <= self.verify_tokens <= most:
            raise ConfigError(
                SpecConfig,
                "num_draft_tokens",
                f"must be in [2, {most}] for topk "
                f"{self.topk} and {self.num_steps} steps, got {self.verify_tokens}",
            )
        self._check_method_keys()
        if self.policy == "static" and self.profile_budget is not None:
            raise ConfigError(SpecConfig, "profile_budget", "applies to the adaptive policy "
                              "only (a static one profiles nothing): drop it or choose adaptive")
        if not self.enabled:
            if self.policy != "static":
                raise ConfigError(SpecConfig, "policy",
                                  f"{self.policy} needs speculation: choose a method and a "
                                  "draft model")
            if self.draft_model:
                raise ConfigError(
                    SpecConfig,
                    "draft_model",
                    f"{self.draft_model!r} is set but "
                    "speculation is off (algorithm 'none'); drop the draft model "
                    "or choose a method",
                )
            return
        if method.draft and not self.draft_model:
            raise ConfigError(
                SpecConfig, "draft_model", f"is required by {self.algorithm}: {method.draft}"
            )
        if not method.draft and self.draft_model:
            why = ("drafts with the target's own MTP/NextN layer, read from the target's files"
                   if self.algorithm == "mtp" else "takes no draft model")
            raise ConfigError(SpecConfig, "draft_model",
                              f"{self.draft_model!r}: method {self.algorithm} {why}; drop it")
        if self.synthetic_accept_len > self.num_steps + 1:
            raise ConfigError(
                SpecConfig,
                "synthetic_accept_len",
                f"must be <= num_steps + 1 = {self.num_steps + 1}, got {self.synthetic_accept_len}",
            )

    def _check_method_keys(self) -> None:
        """Method-specific keys: refused for other methods; ngram drafts chains only."""
        for name, owner in METHOD_KEYS.items():
            if getattr(self, name) is not None and owner != self.algorithm \
                    and owner not in self.extra_methods:
                raise ConfigError(SpecConfig, name, f"applies to method {owner} only, not "
                                  f"{self.algorithm!r} (or a mode '{owner}:...')")
        if self.algorithm == "ngram":
            lo, hi = self.lookup_range
            if lo > hi:
                raise ConfigError(SpecConfig, "prompt_lookup_min",
                                  f"{lo} is above prompt_lookup_max {hi}")
            for name in [mode_name(self.topk, self.num_steps, self.verify_tokens),
                         *self.modes_of("ngram")]:
                topk, steps, tokens = parse_mode(name)
                if topk != 1 or tokens != steps + 1:
                    raise ConfigError(SpecConfig, "modes" if name in self.mode_names else "topk",
                                      f"ngram drafts a chain: mode {name} is a tree (use topk "
                                      "1 and no num_draft_tokens; chainS modes)")

    @property
    def lookup_range(self) -> tuple[int, int]:
        """ngram: (prompt_lookup_min, prompt_lookup_max) with their defaults."""
        hi = self.prompt_lookup_max or max(4, self.prompt_lookup_min or 1)
        return self.prompt_lookup_min or 1, hi

    @property
    def suffix_settings(self) -> tuple[int, int, float]:
        """suffix: (max match length, cached requests, min token probability), defaults in."""
        return (
            8 if self.suffix_max_match_len is None else self.suffix_max_match_len,
            1000 if self.suffix_max_cached_requests is None else self.suffix_max_cached_requests,
            0.1 if self.suffix_min_token_prob is None else self.suffix_min_token_prob,
        )

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def synthetic(self) -> bool:
        """Cost-only acceptance (fixed length or random per request): the output is not the
        target's."""
        return bool(self.synthetic_accept_len or self.synthetic_accept_rate)

    @property
    def mode_names(self) -> list[str]:
        """The extra draft modes (spec.modes), in order."""
        return [m.strip() for m in self.modes.split(",") if m.strip()]

    @property
    def extra_methods(self) -> list[str]:
        """Methods named by a mode prefix other than the primary one, in order of first use."""
        out: list[str] = []
        for name in self.mode_names:
            method = split_mode(name)[0]
            if method not in (None, self.algorithm) and method not in out:
                out.append(method)
        return out

    def modes_of(self, method: str) -> list[str]:
        """The shape names --spec-modes gives `method` (unprefixed ones: the primary's)."""
        out = []
        for name in self.mode_names:
            m, shape = split_mode(name)
            if (m or self.algorithm) == method and shape not in out:
                out.append(shape)
        return out

    def mode_key(self, name: str) -> str:
        """A --spec-modes entry as the worker keys it (the primary's shapes unprefixed)."""
        method, shape = split_mode(name)
        return full_mode_name(method, shape, self.algorithm)

    def for_method(self, method: str) -> SpecConfig:
        """The config one drafter of this engine sees, as if it were the only one: the
        primary's shapes, or an extra method's (its first mode the configured shape)."""
        keys = {k: None for k, owner in METHOD_KEYS.items() if owner != method}
        if method == self.algorithm:
            return dataclasses.replace(self, modes=",".join(self.modes_of(method)), **keys)
        shapes = self.modes_of(method)
        if not shapes:
            raise ValueError(f"no draft mode names method {method!r}")
        topk, steps, tokens = parse_mode(shapes[0])
        return dataclasses.replace(
            self, algorithm=method, draft_model="", topk=topk, num_steps=steps,
            num_draft_tokens=tokens, modes=",".join(shapes[1:]),
            synthetic_accept_len=min(self.synthetic_accept_len, steps + 1), **keys)

    @property
    def verify_tokens(self) -> int:
        """Tokens run through the target per cycle, the root included."""
        if self.num_draft_tokens:
            return self.num_draft_tokens
        return self.num_steps + 1

    def describe(self) -> str:
        """One line for start-up logs: whether speculation is on and how."""
        if not self.enabled:
            return "speculation off"
        shape = "chain" if self.topk == 1 else f"tree topk {self.topk}"
        head = "the target's MTP layer" if self.algorithm == "mtp" else self.draft_model
        text = (
            f"speculation {self.algorithm} ({shape}, {self.num_steps} draft steps, "
            f"{self.verify_tokens} tokens verified per cycle; "
            + (f"head {head})" if head else "no draft model)")
        )
        if self.algorithm == "ngram":
            text += " prompt lookup n in [{}, {}]".format(*self.lookup_range)
        if self.algorithm == "suffix":
            text += " suffix match <= {}, {} cached outputs, min prob {}".format(
                *self.suffix_settings)
        if self.mode_names or self.policy != "static":
            text += f"; policy {self.policy}, modes {', '.join(self.mode_names) or '-'}"
        if self.extra_methods:
            text += f" (extra drafters: {', '.join(self.extra_methods)}, no model of their own)"
        if self.synthetic_accept_len:
            text += f" [COST-ONLY: accept length forced to {self.synthetic_accept_len}]"
        if self.synthetic_accept_rate:
            text += (f" [COST-ONLY: random acceptance, mean rate "
                     f"{self.synthetic_accept_rate}]")
        return text


# fields that only one method reads (None: unset)
METHOD_KEYS: dict[str, str] = {
    "prompt_lookup_max": "ngram",
    "prompt_lookup_min": "ngram",
    "suffix_max_match_len": "suffix",
    "suffix_max_cached_requests": "suffix",
    "suffix_min_token_prob": "suffix",
}

# speculative-config key -> SpecConfig field: vLLM's names, then this engine's own
KEYS: dict[str, str] = {
    "method": "algorithm",
    "model": "draft_model",
    "num_speculative_tokens": "num_steps",
    "suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
    **{f.name: f.name for f in fields(SpecConfig)},
}


def parse_speculative_config(value: str | dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """{SpecConfig field: (the key the user wrote, value)} from a speculative config (a JSON
    object or a dict). Unknown keys, and two keys for one field with different values, raise
    ValueError naming them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"is not valid JSON ({exc.msg}); give an object such as "
                '\'{"method": "eagle3", "model": "PATH", '
                '"num_speculative_tokens": 3}\''
            ) from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    out: dict[str, tuple[str, Any]] = {}
    for key, v in value.items():
        name = KEYS.get(key)
        if name is None:
            raise ValueError(f"has an unknown key {key!r}; known keys: {', '.join(KEYS)}")
        if name in out and out[name][1] != v:
            raise ValueError(
                f"sets {out[name][0]!r}={out[name][1]!r} and {key!r}={v!r}, which "
                "mean the same; give one"
            )
        out[name] = (key, v)
    return out


def build_spec_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> SpecConfig:
    """SpecConfig from field values. A draft model given without a method means EAGLE-3 (the
    one method taking a head). A bad value raises ValueError naming the user's key (`keys`:
    field -> key) or ConfigError naming the field."""
    if values.get("draft_model") and "algorithm" not in values:
        values = {**values, "algorithm": "eagle3"}
    if values and "algorithm" not in values:
        raise ValueError("needs 'method' (e.g. \"eagle3\") or 'model'")
    try:
        return SpecConfig(**values)
    except ConfigError as exc:
        if keys and exc.name in keys:
            raise ValueError(f"{keys[exc.name]!r}: {exc.detail}") from None
        raise


def speculative_config(value: str | dict[str, Any] | SpecConfig | None) -> SpecConfig:
    """The SpecConfig a user's speculative config describes (None: speculation off); errors
    start with 'speculative_config'."""
    if value is None or isinstance(value, SpecConfig):
        return value or SpecConfig()
    try:
        parsed = parse_speculative_config(value)
        return build_spec_config(
            {k: v for k, (_, v) in parsed.items()}, {k: key for k, (key, _) in parsed.items()}
        )
    except ValueError as exc:
        raise ValueError(f"speculative_config {exc}") from None
