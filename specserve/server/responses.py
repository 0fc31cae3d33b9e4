"""OpenAI-compatible response shapes: one envelope for the four (completion, chat, and their
stream chunks)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from specserve import __version__

# names the build that answered (OpenAI's system_fingerprint): the server version
SYSTEM_FINGERPRINT = f"fp_specserve_{__version__}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    # {tokens, token_logprobs, top_logprobs, text_offset} when asked (server/logprobs.py)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None  # "stop" | "length"; None until the last chunk


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, str]  # {"role": "assistant", "content": ...}
    logprobs: dict[str, Any] | None = None  # {"content": [...]} when asked
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": ...}
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ResponseBody(BaseModel):
    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[CompletionChoice | ChatChoice | ChatChunkChoice]
    usage: Usage | None = None  # streams: null, then a last usage-only chunk if asked for
    system_fingerprint: str = SYSTEM_FINGERPRINT


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def full_response(
    chat: bool,
    rid: str,
    model: str,
    choices: list[tuple[str, str, dict[str, Any] | None]],
    usage: Usage,
) -> ResponseBody:
    """The non-streamed answer; choices: (text, finish reason, logprobs) per choice."""
    return ResponseBody(
        id=rid,
        object="chat.completion" if chat else "text_completion",
        created=int(time.time()),
        model=model,
        choices=[
            ChatChoice(index=i, message={"role": "assistant", "content": text},
                       finish_reason=finish, logprobs=lp)
            if chat
            else CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=lp)
            for i, (text, finish, lp) in enumerate(choices)
        ],
        usage=usage,
    )


def stream_chunk(
    chat: bool,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    role: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> ResponseBody:
    """One streamed chunk of choice `index`; text None = the final usage-only chunk (empty
    choices)."""
    choices: list[CompletionChoice | ChatChoice | ChatChunkChoice] = []
    if text is not None and chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choices = [ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                   logprobs=logprobs)]
    elif text is not None:
        choices = [CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                    logprobs=logprobs)]
    return ResponseBody(
        id=rid,
        object="chat.completion.chunk" if chat else "text_completion",
        created=created,
        model=model,
        choices=choices,
        usage=usage,
    )
