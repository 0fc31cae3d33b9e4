"""OpenAI-compatible request and response shapes for /v1/completions and /v1/chat/completions.

Requests are parsed strictly (no "10" -> 10, no 1.5 -> 1, no NaN / Infinity): anything a client
gets wrong becomes an `APIError` carrying the OpenAI error envelope, with `param` naming the
offending field and a message that says what to change. Implemented: n (<= MAX_N, one
engine request per choice), logprobs / top_logprobs (<= --max-logprobs), echo (with logprobs:
the prompt's log-probs too), presence/frequency/repetition penalties, min_tokens, logit_bias.
Fields OpenAI defines but we do not implement (tools, tool_choice, functions, response_format
other than text, suffix, best_of other than n, ...) are declared and refused with a 400
naming them, and so are vLLM extensions we lack (REFUSED_EXTRAS). Other unknown fields are
ignored, as OpenAI clients send extras (metadata, store, ...), and logged once per name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from specserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from specserve.server.errors import bad_request, echo, validation_error
from specserve.server.parsing import parse_request_json, warn_ignored

# vLLM extensions a client may send expecting an effect that this server does not have:
# refused by name when set, never silently ignored
REFUSED_EXTRAS = ("prompt_logprobs", "allowed_token_ids", "bad_words", "guided_json",
                  "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                  "truncate_prompt_tokens", "use_beam_search", "length_penalty",
                  "chat_template", "chat_template_kwargs", "continue_final_message",
                  "logits_processors", "return_tokens_as_token_ids")


def parse_request(
    body: bytes,
    content_type: str,
    model: type[CommonRequest],
    max_items: dict[str, tuple[int, str]] | None = None,
) -> Any:
    """Parse and validate a JSON request body; APIError(400) naming what is wrong.

    max_items: field -> (most list items, why), checked on the parsed JSON before validation
    (a field ending in "[].content" caps the content parts of each message)."""
    obj = parse_request_json(body, content_type, {**model.MAX_ITEMS, **(max_items or {})})
    if isinstance(obj, dict):
        for name in REFUSED_EXTRAS:
            if obj.get(name) not in (None, False, [], {}):
                raise bad_request(f"{name} is not supported; omit the field", name)
    try:
        req = model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if isinstance(obj, dict):
        warn_ignored(set(obj) - set(model.model_fields))
    for name, accepted, hint in req.UNSUPPORTED:
        if not accepted(getattr(req, name)):
            raise bad_request(f"{name}={echo(getattr(req, name))} is not supported; {hint}", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true; drop it or stream",
                          "stream_options")
    req.check_choices()
    return req


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _unset(value: Any) -> bool:
    return not value


class StreamOptions(_Strict):
    """OpenAI's include_usage (a last usage-only chunk) and vLLM's continuous_usage_stats (usage
    so far on every chunk); any other key is refused, naming it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonRequest(_Strict):
    """Fields shared by completions and chat completions (OpenAI + common vLLM extensions)."""

    # list fields capped before validation: field -> (most items, why)
    MAX_ITEMS: ClassVar[dict[str, tuple[int, str]]] = {
        "stop": (MAX_STOP_STRINGS, "the stop-string cap"),
        "stop_token_ids": (MAX_STOP_TOKEN_IDS, "the stop-token cap"),
        "logit_bias": (MAX_LOGIT_BIAS, "the logit_bias cap"),
    }
    # (field, accepts its value?, what to do instead): OpenAI fields we do not implement
    UNSUPPORTED: ClassVar[tuple[tuple[str, Callable[[Any], bool], str], ...]] = ()

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for abuse tracking: nothing to apply

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int | None) -> int | None:
        if n is not None and not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
        return n

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def logprobs_k(self) -> int | None:
        """Alternatives per token the request asks for; None: no log-probs."""
        raise NotImplementedError

    def check_choices(self) -> None:
        """Cross-field checks of the request kind (after the field checks)."""

    def prompt_logprobs_k(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def build_params(
        self,
        requested: int | None,
        num_prompt: int,
        max_model_len: int,
        room: int,
        vocab_size: int,
        default_cap: int | None,
        prompt_param: str,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """SamplingParams under the length policy. room: the most new tokens that fit beside
        the prompt, in the context and in the KV pool (Scheduler.max_new_tokens). The prompt
        must leave room for one token; an explicit max_tokens must fit (else 400); an omitted
        one is clamped to the room (and to default_cap). `defaults`: the model's generation-config
        sampling values, for fields the request leaves out."""
        if num_prompt >= max_model_len:
            raise bad_request(
                f"the prompt is {num_prompt} tokens but the context is "
                f"{max_model_len}; shorten the prompt",
                prompt_param,
            )
        if room < 1:
            raise bad_request(
                f"the prompt is {num_prompt} tokens and leaves no room in the KV "
                "cache; shorten the prompt",
                prompt_param,
            )
        if requested is None:
            max_tokens = room if default_cap is None else min(room, default_cap)
        elif requested > room:
            raise bad_request(
                f"max_tokens={requested} does not fit: the prompt is {num_prompt} "
                f"tokens and at most {room} more fit (context {max_model_len}, "
                f"and the KV cache); lower max_tokens to at most {room}",
                "max_tokens",
            )
        else:
            max_tokens = requested
        params = self.sampling_params(max_tokens, defaults)
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias)):
            for t in ids:
                if t >= vocab_size:
                    raise bad_request(
                        f"{name} token ids must be < the vocab size {vocab_size}, got {t}", name
                    )
        return params

    def sampling_params(self, max_tokens: int,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Build SamplingParams; APIError(400) naming the field on an out-of-range value.
        Sampling fields left out take `defaults`, else OpenAI's defaults."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                "repetition_penalty")}
        sampling = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {echo(key)}",
                                  "logit_bias")
            bias[int(key)] = value
        try:
            return SamplingParams(
                **sampling,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                min_tokens=self.min_tokens,
                logit_bias=bias,
                logprobs=self.logprobs_k(),
                prompt_logprobs=self.prompt_logprobs_k(),
                seed=self.seed,
                max_tokens=max_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as exc:
            # SamplingParams messages start with the field's name ("top_p must be ..."),
            # except the stop-string ones ("at most N stop strings").
            msg = str(exc)
            field = "stop" if "stop strings" in msg else msg.split(" ")[0].split("[")[0]
            param = field if field in type(self).model_fields else None
            raise bad_request(msg, param) from None


class CompletionRequest(CommonRequest):
    UNSUPPORTED = CommonRequest.UNSUPPORTED + (
        ("suffix", _unset, "omit the field (no fill-in-the-middle)"),
    )

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def logprobs_k(self) -> int | None:
        if self.logprobs is not None and self.logprobs < 0:
            raise bad_request(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        """echo with logprobs reports the prompt tokens' log-probs too."""
        return self.logprobs if self.echo else None

    def check_choices(self) -> None:
        """best_of: only the trivial best_of == n (no ranking of extra candidates)."""
        if self.best_of is not None and self.best_of != self.num_choices:
            raise bad_request(
                f"best_of={self.best_of} is not supported; leave it out or equal to n "
                f"({self.num_choices}), or send n={self.best_of} and rank the choices yourself",
                "best_of",
            )

    def single_prompt(self, vocab_size: int) -> str | list[int]:
        """The one prompt: a string or token ids in [0, vocab_size) (no batches)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(
                    f"one prompt per request is supported, got a batch of {len(prompt)}; send "
                    "one request per prompt",
                    "prompt",
                )
            prompt = prompt[0]
        if len(prompt) == 0:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(
                    f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", "prompt"
                )
        return prompt


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None
    name: str | None = None

    def text(self, index: int) -> str:
        """Plain-text content; only "text" parts are supported."""
        if self.content is None:
            raise bad_request(
                f"messages[{index}].content must be a string, got null",
                f"messages[{index}].content",
            )
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                media = any(m in part.type for m in ("image", "video", "audio", "file"))
                why = ("this server runs the model's language part only (a vision-language "
                       "checkpoint is served text-only: its vision tower is not loaded); send "
                       "text parts" if media else "only text parts are")
                raise bad_request(
                    f"content part type {echo(part.type)} is not supported; {why}",
                    f"messages[{index}].content[{j}].type",
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(CommonRequest):
    UNSUPPORTED = CommonRequest.UNSUPPORTED + tuple(
        (name, _unset, "omit the field (no tool or function calling)")
        for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
    ) + (
        (
            "response_format",
            lambda v: v is None or v.get("type") == "text",
            "only {'type': 'text'} is supported (no structured output)",
        ),
        ("audio", _unset, "omit the field (text only)"),
        ("modalities", lambda v: v is None or v == ["text"], "only ['text'] is supported"),
        ("prediction", _unset, "omit the field"),
        ("reasoning_effort", _unset, "omit the field"),
        ("web_search_options", _unset, "omit the field"),
    )

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise bad_request(f"top_logprobs must be >= 0, got {self.top_logprobs}",
                              "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


    @field_validator("messages")
    @classmethod
    def _check_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must hold at least one message")
        return value

    def requested_max_tokens(self) -> int | None:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise bad_request(
                "max_tokens and max_completion_tokens disagree; send only one",
                "max_completion_tokens",
            )
        return a if a is not None else b

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i),
             **({"name": m.name} if m.name is not None else {})}
            for i, m in enumerate(self.messages)
        ]
