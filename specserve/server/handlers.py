"""The generation endpoints: validate, bound, tokenize, admit, then stream or collect.

Before any tokenization a request is refused when it cannot fit: a text prompt longer than the
context can hold in characters (context x the tokenizer's most characters per token), more
chat messages or content parts than the context has tokens, a token-id prompt longer than
the context. Tokenization then runs in a worker thread without the interpreter lock, so a
long prompt stalls neither the event loop nor the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.engine.plan import QueueFullError
from specserve.sampling_params import SamplingParams
from specserve.server import errors as E
from specserve.server import protocol as P
from specserve.server import responses as R
from specserve.server.async_engine import AsyncEngine
from specserve.server.choices import Choices as _Choices
from specserve.server.choices import merged as _merged
from specserve.server.guard import RETRY_AFTER_S
from specserve.server.logprobs import LogprobFormatter
from specserve.server.streams import (
    EngineDeadError,
    EngineDrainingError,
    RequestStream,
    RequestTimeoutError,
)

log = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INTERNAL_ERROR = "internal server error; the server log has the details"
_ENGINE_ERRORS = (QueueFullError, EngineDrainingError, EngineDeadError, RequestTimeoutError)


class _SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client leaving (whatever the ASGI spec
    version): a disconnect cancels the body iterator, whose `finally` aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close  # also covers a client gone before the body iterator started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()  # runs its `finally` now, not at garbage collection
        self.on_close()


def _sse(payload: R.ResponseBody | dict[str, Any] | str) -> str:
    if isinstance(payload, R.ResponseBody):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def engine_error(exc: Exception) -> E.APIError:
    """The envelope for an engine-side refusal or failure (the messages hold no internals)."""
    retry = {"Retry-After": RETRY_AFTER_S}
    if isinstance(exc, QueueFullError):
        return E.APIError(
            429,
            str(exc) or "the waiting queue is full; retry later",
            type="rate_limit_error",
            code="queue_full",
            headers=retry,
        )
    if isinstance(exc, RequestTimeoutError):
        return E.APIError(504, str(exc), type="timeout_error", code="request_timeout")
    code = "shutting_down" if isinstance(exc, EngineDrainingError) else "engine_dead"
    return E.APIError(503, str(exc), type="service_unavailable", code=code, headers=retry)


class Handler:
    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names
        self.model_name = model_names[0]  # what responses report
        self.vocab_size = engine.engine.model_config.vocab_size
        # the model's generation-config sampling values, for fields a request leaves out
        self.defaults = engine.engine.generation_defaults.params
        self.max_len = engine.max_model_len
        self.max_logprobs = engine.engine.config.max_logprobs
        per_token = getattr(engine.tokenizer, "max_chars_per_token", None)
        # characters a prompt may have and still fit the context (None: no sound bound)
        self.max_chars = None if per_token is None else self.max_len * per_token

    def admit_fast(self, req: P.CommonRequest) -> None:
        if req.model is not None and req.model not in self.model_names:
            raise E.APIError(
                404,
                f"model {E.echo(req.model)} not found; this server serves "
                f"{' | '.join(map(repr, self.model_names))} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        try:
            self.engine.check_admission()
        except _ENGINE_ERRORS as exc:
            raise engine_error(exc) from None

    def check_chars(self, num_chars: int, param: str) -> None:
        if self.max_chars is not None and num_chars > self.max_chars:
            raise E.bad_request(
                f"{param} is {num_chars} characters; a context of {self.max_len} tokens holds "
                f"at most {self.max_chars} characters with this tokenizer; shorten it",
                param,
            )

    async def encode(self, fn: Callable[..., list[int]], arg: Any, param: str) -> list[int]:
        try:
            return list(await asyncio.to_thread(fn, arg))
        except Exception as exc:  # e.g. a chat template refusing the conversation
            raise E.bad_request(f"could not tokenize {param}: {E.echo(str(exc))}", param) from None

    def _params(
        self,
        req: P.CommonRequest,
        requested: int | None,
        ids: list[int],
        default_cap: int | None,
        param: str,
    ) -> SamplingParams:
        room = self.engine.max_new_tokens(len(ids))
        return req.build_params(
            requested, len(ids), self.max_len, room, self.vocab_size, default_cap, param,
            self.defaults,
        )

    async def _parse(self, request: Request, model: type, limits: dict[str, str]) -> Any:
        """The validated request; `limits`: list fields capped at the context (and why)."""
        caps = {name: (self.max_len, why) for name, why in limits.items()}
        content_type = request.headers.get("content-type", "")
        req = P.parse_request(await request.body(), content_type, model, caps)
        self.admit_fast(req)
        return req

    async def completions(self, request: Request) -> Response:
        why = "a longer prompt cannot fit the context"
        req: P.CompletionRequest = await self._parse(request, P.CompletionRequest, {"prompt": why})
        prompt = req.single_prompt(self.vocab_size)
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            ids = await self.encode(self.engine.tokenizer.encode, prompt, "prompt")
        else:
            ids = prompt
        params = self._params(req, req.max_tokens, ids, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        echo = None
        if req.echo:  # the prompt text before the completion (token-id prompts decoded)
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(
                self.engine.tokenizer.decode, prompt)
        return await self._run(request, req, R.new_id("cmpl"), ids, params, chat=False,
                               echo=echo)

    async def chat(self, request: Request) -> Response:
        why = "each takes at least one token of the context"
        req: P.ChatCompletionRequest = await self._parse(
            request, P.ChatCompletionRequest, {"messages": why, "messages[].content": why}
        )
        messages = req.chat_messages()
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        ids = await self.encode(self.engine.tokenizer.apply_chat_template, messages, "messages")
        params = self._params(req, req.requested_max_tokens(), ids, None, "messages")
        return await self._run(request, req, R.new_id("chatcmpl"), ids, params, chat=True)

    def _check_logprobs(self, req: P.CommonRequest, params: SamplingParams) -> None:
        cap = self.max_logprobs
        if params.logprobs is not None and params.logprobs > cap:
            name = "top_logprobs" if isinstance(req, P.ChatCompletionRequest) else "logprobs"
            raise E.bad_request(f"{name} must be at most {cap} (the server's --max-logprobs), "
                                f"got {params.logprobs}", name)

    async def _run(
        self,
        request: Request,
        req: P.CommonRequest,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        chat: bool,
        echo: str | None = None,
    ) -> Response:
        """One engine request per choice (choice i > 0 of a seeded request gets a seed
        derived from (seed, i)); the prefix cache shares their prompt."""
        self._check_logprobs(req, params)
        n = req.num_choices
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                choice_params = params.for_choice(i)
                streams.append(await self.engine.add_request(
                    rid if n == 1 else f"{rid}-{i}", ids, choice_params))
        except (*_ENGINE_ERRORS, ValueError) as exc:
            for st in streams:
                st.close()
            if isinstance(exc, ValueError):
                raise E.bad_request(str(exc)) from None
            raise engine_error(exc) from None
        view = _Choices(chat, LogprobFormatter(self.engine.tokenizer), echo, ids,
                        params.prompt_logprobs is not None, n)
        if req.stream:
            return _SSEResponse(self._events(streams, rid, view, req.include_usage,
                                             req.continuous_usage),
                                lambda: [st.close() for st in streams])
        return await self._collect(request, streams, rid, view)

    async def _collect(self, request: Request, streams: list[RequestStream], rid: str,
                       view: _Choices) -> Response:
        async def close_on_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for st in streams:
                st.close()  # aborts the requests and ends the iteration below

        watcher = asyncio.create_task(close_on_disconnect())
        try:
            async for i, out in _merged(streams):
                view.add(i, out)
        except _ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        finally:
            watcher.cancel()
            for st in streams:
                st.close()
        lasts = view.last
        if any(last is None or not last.finished for last in lasts):
            return Response(status_code=499)  # the client left; nobody reads this
        if any(last.finish_reason not in ("stop", "length") for last in lasts):
            raise E.APIError(
                503, "the request was aborted; retry it", type="server_error", code="aborted"
            )
        body = R.full_response(view.chat, rid, self.model_name, view.choices(), view.usage())
        return Response(body.model_dump_json(), media_type="application/json")

    async def _events(self, streams: list[RequestStream], rid: str, view: _Choices,
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(i: int, text: str | None, finish: str | None = None,
                  usage: R.Usage | None = None, role: bool = False,
                  logprobs: dict[str, Any] | None = None) -> str:
            if continuous_usage and usage is None:  # vLLM's continuous_usage_stats
                usage = view.usage()
            return _sse(R.stream_chunk(view.chat, rid, self.model_name, created, text, finish,
                                       usage, role, i, logprobs))

        try:
            for i in range(len(streams)):
                if view.chat:
                    yield chunk(i, "", role=True)
                elif view.echo and not view.prompt_logprobs:
                    yield chunk(i, view.echo)
            async for i, out in _merged(streams):
                if out.finished and out.finish_reason not in ("stop", "length"):
                    yield _sse(
                        E.error_body("the request was aborted", "server_error", None, "aborted")
                    )
                    return
                view.add(i, out)
                if out.prompt_logprobs is not None and view.echo:  # the echo, once its
                    yield chunk(i, view.echo, logprobs=view.prompt_block(i))  # log-probs exist
                if out.new_text or out.finished:  # log-probs of held-back text wait for it
                    yield chunk(i, out.new_text, out.finish_reason if out.finished else None,
                                logprobs=view.pending_logprobs(i))
            if any(last is None for last in view.last):
                return  # closed without output: the client left
            if include_usage:
                yield chunk(0, None, usage=view.usage())
            yield _sse("[DONE]")
        except _ENGINE_ERRORS as exc:
            yield _sse(engine_error(exc).body())
        except Exception:  # a server bug: report it in-band, the status is already 200
            log.exception("stream %s failed", rid)
            yield _sse(E.error_body(INTERNAL_ERROR, "server_error", None, 500))
        finally:
            for st in streams:
                st.close()

