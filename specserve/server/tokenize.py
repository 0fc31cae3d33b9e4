"""/tokenize and /detokenize (vLLM's request and response shapes) and /version.

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                      or {"messages": [...], "add_generation_prompt": true}  (chat template)
                   -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /version     {"version": str}
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from specserve import __version__
from specserve.server import errors as E
from specserve.server import protocol as P


class TokenizeRequest(P._Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(P._Strict):
    model: str | None = None
    tokens: list[int]


def _parse(handler: Any, body: bytes, content_type: str, model: type) -> Any:
    caps = {"tokens": (handler.max_len, "a longer sequence cannot fit the context")}
    try:
        req = model.model_validate(P.parse_request_json(body, content_type, caps))
    except ValidationError as exc:
        raise E.validation_error(exc) from None
    if req.model is not None and req.model not in handler.model_names:
        raise E.APIError(404, f"model {E.echo(req.model)} not found", param="model",
                         code="model_not_found")
    return req


async def tokenize(handler: Any, request: Request) -> JSONResponse:
    req: TokenizeRequest = _parse(handler, await request.body(),
                                  request.headers.get("content-type", ""), TokenizeRequest)
    tok = handler.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise E.bad_request("send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        handler.check_chars(len(req.prompt), "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await handler.encode(lambda p: tok.encode(p, add_special_tokens=special),
                                   req.prompt, "prompt")
    else:
        messages = P.ChatCompletionRequest.model_construct(messages=req.messages).chat_messages()
        ids = await handler.encode(
            lambda m: tok.apply_chat_template(
                m, add_generation_prompt=req.add_generation_prompt), messages, "messages")
    strs = [tok.decode([t], skip_special_tokens=False) for t in ids] \
        if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": handler.max_len, "tokens": ids,
                         "token_strs": strs})


async def detokenize(handler: Any, request: Request) -> JSONResponse:
    req: DetokenizeRequest = _parse(handler, await request.body(),
                                    request.headers.get("content-type", ""), DetokenizeRequest)
    bad = [t for t in req.tokens if not 0 <= t < handler.vocab_size]
    if bad:
        raise E.bad_request(f"tokens must be in [0, {handler.vocab_size}), got {bad[0]}",
                            "tokens")
    text = await asyncio.to_thread(handler.engine.tokenizer.decode, req.tokens)
    return JSONResponse({"prompt": text})


async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
