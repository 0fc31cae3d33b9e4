"""The choices of one response: n engine requests read as one (merged streams), and what
they have produced so far (texts, log-probs, usage)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from specserve.engine.engine import RequestOutput
from specserve.server import responses as R
from specserve.server.logprobs import LogprobFormatter
from specserve.server.streams import RequestStream


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they come; one stream is read as is."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as exc:  # re-raised by the reader
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


class Choices:
    """What the choices of one response have produced so far (texts, log-probs, usage)."""

    def __init__(self, chat: bool, fmt: LogprobFormatter, echo: str | None,
                 prompt_ids: list[int], prompt_logprobs: bool = False, n: int = 1) -> None:
        self.chat, self.fmt, self.echo = chat, fmt, echo
        self.prompt_ids, self.num_prompt = prompt_ids, len(prompt_ids)
        # echo with logprobs: the prompt's tokens lead each choice's log-probs
        self.prompt_logprobs = prompt_logprobs
        self.prompt_entries: dict[int, list] = {}
        self.texts: dict[int, list[str]] = {}
        self.last: list[RequestOutput | None] = [None] * n  # per choice: its newest output
        self.token_ids: dict[int, list[int]] = {}
        self.entries: dict[int, list[list]] = {}
        self.sent: dict[int, int] = {}  # log-prob entries already streamed
        self.offset: dict[int, int] = {}  # text offset of the next streamed token

    def add(self, i: int, out: RequestOutput) -> bool:
        """Record an output of choice i; whether it carried log-probs."""
        self.last[i] = out
        self.texts.setdefault(i, []).append(out.new_text)
        if out.prompt_logprobs is not None:
            self.prompt_entries[i] = out.prompt_logprobs
        if out.new_logprobs is None:
            return False
        self.token_ids.setdefault(i, []).extend(out.new_token_ids)
        self.entries.setdefault(i, []).extend(out.new_logprobs)
        return True

    def _block(self, i: int, start: int) -> dict[str, Any] | None:
        if i not in self.entries:
            return None
        ids, entries = self.token_ids[i][start:], self.entries[i][start:]
        if self.chat:
            return self.fmt.chat(ids, entries)
        block, self.offset[i] = self.fmt.completion(ids, entries, self.offset.get(
            i, len(self.echo or "")))
        return block

    def pending_logprobs(self, i: int) -> dict[str, Any] | None:
        """The log-probs of choice i's tokens not streamed yet."""
        start = self.sent.get(i, 0)
        self.sent[i] = len(self.entries.get(i, ()))
        return self._block(i, start)

    def prompt_block(self, i: int) -> dict[str, Any] | None:
        """Completions' log-probs of choice i's prompt tokens (the first has none); the
        completion's text offsets continue after them."""
        if i not in self.prompt_entries:
            return None
        block, self.offset[i] = self.fmt.completion(self.prompt_ids, self.prompt_entries[i], 0)
        return block

    def choices(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        out = []
        for i, last in enumerate(self.last):
            lead = self.prompt_block(i)
            block = self._block(i, 0)
            if lead is not None and block is not None:
                block = {k: lead[k] + block[k] for k in block}
            out.append(((self.echo or "") + "".join(self.texts[i]), last.finish_reason,
                        block))
        return out

    def usage(self) -> R.Usage:
        """The prompt once, the completion tokens of every choice."""
        lasts = [x for x in self.last if x is not None]
        return R.Usage.of(self.num_prompt, sum(x.num_output_tokens for x in lasts),
                          lasts[0].num_cached_tokens if lasts else 0)
