"""Per-request text: the model's tokenizer for an engine, and each request's incremental
detokenization with stop-string matching."""

from __future__ import annotations

from specserve.config import EngineConfig
from specserve.engine.request import Request
from specserve.stop_strings import StopStringMatcher
from specserve.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    has_tokenizer,
    load_tokenizer,
    read_chat_template,
)


def engine_tokenizer(config: EngineConfig, model_path: str | None) -> Tokenizer | None:
    """The model's tokenizer (with --chat-template applied); random-weight benchmark models
    may have none (then prompts must be token ids)."""
    path = config.tokenizer or model_path
    if config.load_format == "dummy" and (path is None or not has_tokenizer(path)):
        if config.chat_template:
            raise ValueError("--chat-template needs a tokenizer; this random-weight model "
                             "has none (pass --tokenizer DIR)")
        return None
    tokenizer = load_tokenizer(path)
    if config.chat_template:
        tokenizer.hf.chat_template = read_chat_template(config.chat_template)
    return tokenizer


class TextState:
    """One request's detokenization and stop-string matching."""

    def __init__(self, tokenizer: Tokenizer | None, req: Request) -> None:
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
                      if tokenizer is not None else None)
        self.stops = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)
        self.emitted = 0  # output tokens already reported (new_ids follow them)

    def new_text(self, req: Request, new_ids: list[int]) -> tuple[str, bool]:
        """(the text of new_ids, whether a stop string matched: the caller finishes the
        request). A finished request's held-back text is released."""
        if self.detok is None:
            return "", False
        # stop strings count from min_tokens on, as EOS and stop_token_ids do: the text of
        # the earlier tokens passes unmatched (a stop string cannot end inside it)
        early = max(0, req.params.min_tokens - (self.emitted - len(new_ids)))
        text = ""
        if early:
            text = self.stops.flush() + self.detok.add(new_ids[:early])
            new_ids = new_ids[early:]
        more, stopped = self.stops.feed(self.detok.add(new_ids))
        text += more
        if stopped:
            return text, True
        if req.is_finished:  # release what was held back for a possible stop string
            tail, stopped = self.stops.feed(self.detok.flush())
            text += tail if stopped else tail + self.stops.flush()
        return text, False
