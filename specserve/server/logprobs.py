"""Log-probs in OpenAI's two response shapes, from the engine's per-token entries.

An entry is [log-prob, [top ids], [top log-probs]] of the target's raw distribution (the
model's log_softmax before penalties, temperature or truncation, as vLLM returns by default).

    completions  {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                  "text_offset": [int]}   the chosen token is always among top_logprobs (vLLM)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs":
                  [{"token", "logprob", "bytes"}]}]}

A token's text is its own decode (a byte-level token that is part of a character shows as
U+FFFD, its bytes as the UTF-8 of that text).
"""

from __future__ import annotations

import math
from typing import Any


def _finite(x: float) -> float:
    """JSON has no -inf: a token with probability 0 (masked) reports float32's lowest."""
    return x if math.isfinite(x) else -3.4028234663852886e38


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = (self.tokenizer.decode([token_id], skip_special_tokens=False)
                                        if self.tokenizer is not None else str(token_id))
        return t

    def completion(self, token_ids: list[int], entries: list[list], offset: int
                   ) -> tuple[dict[str, Any], int]:
        """The completions block of these tokens, text offsets from `offset`; and the
        offset after them."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, entry in zip(token_ids, entries):
            text = self.text(tid)
            out["text_offset"].append(offset)
            offset += len(text)
            out["tokens"].append(text)
            if entry is None:  # a prompt's first token: nothing before it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top_ids, top_lps = entry
            out["token_logprobs"].append(_finite(lp))
            top = {self.text(t): _finite(v) for t, v in zip(top_ids, top_lps)}
            top.setdefault(text, _finite(lp))
            out["top_logprobs"].append(top)
        return out, offset

    def chat(self, token_ids: list[int], entries: list[list]) -> dict[str, Any]:
        """The chat block ({"content": [...]}) of these tokens."""
        def item(tid: int, lp: float) -> dict[str, Any]:
            text = self.text(tid)
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

        return {"content": [
            {**item(tid, lp), "top_logprobs": [item(t, v) for t, v in zip(top_ids, top_lps)]}
            for tid, (lp, top_ids, top_lps) in zip(token_ids, entries)
        ]}
