"""Tokenizer wrapper and incremental detokenizer (stop strings: stop_strings.py).

Text a user sends is always plain text: special-token text inside it (e.g. "<|eot_id|>") is
encoded byte for byte, never as the control token, in `encode` and inside chat messages.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any

import tokenizers

# prompt tokens kept as decoding context, so the first output token decodes as it would in the
# middle of the text (leading-space rules of SentencePiece-style decoders)
_PROMPT_CONTEXT = 5


class Tokenizer:
    """A Hugging Face fast tokenizer with user text kept plain.

    Two copies of the Rust tokenizer are held, one that parses special-token text (used for
    text a chat template writes) and one that does not (user text): no per-call state is
    toggled, so the object is safe to share between threads.
    """

    def __init__(self, hf: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                "specserve needs a fast tokenizer: the directory must hold a tokenizer.json"
            )
        self.hf = hf
        spec = hf.backend_tokenizer.to_str()
        self._special = tokenizers.Tokenizer.from_str(spec)  # parses "<|eos|>" as the token
        self._plain = tokenizers.Tokenizer.from_str(spec)  # encodes it as plain text
        for tok in (self._special, self._plain):
            tok.no_truncation()
            tok.no_padding()
        self._special.encode_special_tokens = False
        self._plain.encode_special_tokens = True
        special = {t.content for t in hf.added_tokens_decoder.values() if t.special}
        longest_first = sorted(special, key=len, reverse=True)
        self._special_re = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )
        eos = [] if hf.eos_token_id is None else [int(hf.eos_token_id)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *eos_token_ids]))
        self.vocab_size: int = len(hf)  # ids the tokenizer knows (the model may pad beyond)
        self.max_chars_per_token = _max_chars_per_token(json.loads(spec), self._plain.get_vocab())

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode user text; special-token text in it stays plain text."""
        return _encode(self._plain, text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._special.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        """Render `messages` with the generation prompt and encode them.

        Special-token text inside message contents is swapped for unique markers before
        rendering; the rendered text is split at the markers, template text is encoded with
        special tokens parsed and the swapped text as plain text.
        """
        if not self.hf.chat_template:
            raise ValueError(
                "this tokenizer has no chat template; use the completions "
                "endpoint with a plain prompt, or a model that ships a template"
            )
        import jinja2

        originals: dict[str, str] = {}  # marker -> special-token text it stands for
        nonce = secrets.token_hex(8)

        def shield(text: str) -> str:
            if self._special_re is None:
                return text

            def marker(m: re.Match[str]) -> str:
                key = f"\ue000{nonce}:{len(originals)}\ue001"
                originals[key] = m.group()
                return key

            return self._special_re.sub(marker, text)

        shielded = [_map_content(m, shield) for m in messages]
        try:
            text = self.hf.apply_chat_template(
                shielded, tokenize=False, add_generation_prompt=add_generation_prompt,
                **template_kwargs
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        if not originals:
            return _encode(self._special, text, False)
        ids: list[int] = []
        for piece in re.split("(" + "|".join(map(re.escape, originals)) + ")", text):
            if piece in originals:
                ids += _encode(self._plain, originals[piece], False)
            elif piece:
                ids += _encode(self._special, piece, False)
        return ids


def _encode(tok: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of one text. The batch entry point runs without the interpreter lock (the
    single-text one holds it throughout), so a long text does not stall other threads."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


# normalizers that never map a run of characters to fewer than 1/4 as many (NFC composes a
# base and its marks, Hangul jamo into syllables); any other may delete characters
_BOUNDED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"}
# pre-tokenizers that keep every character (whitespace splitters drop the whitespace)
_KEEPING_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Digits",
    "Punctuation",
    "UnicodeScripts",
    "Split",
}


def _shrink(component: dict | None, keeping: set[str]) -> int | None:
    """How many characters of input one character after this component may stand for (1 =
    none dropped), or None when it may drop characters outright."""
    if component is None:
        return 1
    kind = component.get("type")
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        factor = 1
        for part in parts:
            f = _shrink(part, keeping)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        return 1 if component.get("content") else None
    if kind == "Split" and str(component.get("behavior", "")).lower() == "removed":
        return None
    if kind in keeping:
        return 4 if kind in ("NFC", "NFD", "NFKC", "NFKD") else 1
    return None


def _max_chars_per_token(spec: dict, vocab: dict[str, int]) -> int | None:
    """A bound on the characters of input text one token can cover, so a text longer than
    context x bound cannot fit the context; None where the tokenizer allows no such bound
    (normalizers or pre-tokenizers that drop characters, unknown characters fused into one
    token)."""
    model = spec.get("model") or {}
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    normalize = _shrink(spec.get("normalizer"), _BOUNDED_NORMALIZERS)
    split = _shrink(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS)
    if normalize is None or split is None or not vocab:
        return None
    # a byte-level vocabulary entry spells one byte per character (a text's characters are
    # at most its bytes); others spell the characters themselves
    return max(len(piece) for piece in vocab) * normalize


def _map_content(message: dict, fn: Any) -> dict:
    """Apply `fn` to a message's text: a string content or the text of content parts."""
    if not isinstance(message, dict):
        raise ValueError(
            f"each message must be an object with role and content, got {type(message).__name__}"
        )
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = fn(content)
    elif isinstance(content, list):
        out["content"] = [
            {**part, "text": fn(part["text"])}
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
    return out


def _generation_tag() -> type:
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        """Parses transformers' `{% generation %} ... {% endgeneration %}` (assistant-mask
        markers) as a plain block."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return GenerationTag


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's rule: text with
    '{', '}' or a newline is a template, anything else must be a file). ValueError for a missing
    file or a template Jinja cannot parse."""
    import jinja2

    _GenerationTag = _generation_tag()
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            text = fh.read()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"{value!r} is not a file (nor inline Jinja text); give a template file "
                         "or the template itself")
    try:  # the extensions transformers renders templates with: loop controls, {% generation %}
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc.message} (line {exc.lineno})"
                         ) from None
    return text


def has_tokenizer(path: str) -> bool:
    """Whether a model directory (or a GGUF file, which always does) carries a tokenizer."""
    if _is_gguf(path):
        return os.path.isfile(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n)) for n in names)


def _is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def load_hf_tokenizer(path: str) -> Any:
    """The transformers fast tokenizer of a model directory, a cached repo id, or a GGUF file
    (built by transformers from the file's vocabulary, merges, special ids and chat
    template)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if _is_gguf(path):
            folder, name = os.path.split(os.path.abspath(path))
            return PreTrainedTokenizerFast.from_pretrained(
                folder, gguf_file=name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    except (OSError, KeyError, ValueError) as e:
        what = (
            "a GGUF file with tokenizer metadata"
            if _is_gguf(path)
            else ("a directory holding tokenizer.json and tokenizer_config.json")
        )
        raise ValueError(f"cannot load a tokenizer from {path!r}: pass {what} ({e})") from e


def load_tokenizer(path: str) -> Tokenizer:
    """Load the fast tokenizer of a model directory, a cached repo id or a GGUF file.

    EOS ids: the tokenizer's eos token plus generation_config.json's eos_token_id entries
    (instruction-tuned models often end turns with a token other than the tokenizer's eos).
    """
    return Tokenizer(load_hf_tokenizer(path), eos_token_ids=_generation_eos_ids(path))


def _generation_eos_ids(path: str) -> tuple[int, ...]:
    if _is_gguf(path):  # a GGUF file's end ids come with its config (models/gguf.py)
        return ()
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return ()
    with open(file) as fh:
        eos = json.load(fh).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text.

    Two offsets into the ids bound the decoding window (cost O(window), not O(output)):

        ids:  ... | prefix (already emitted) | read (new, not yet emitted) |
                  ^ prefix_offset            ^ read_offset

    Each step decodes ids[prefix_offset:] and ids[prefix_offset:read_offset] and emits the
    difference. While the decoded tail ends in U+FFFD (a multi-byte character split across
    tokens) nothing is emitted and the offsets stay, so no partial character ever escapes.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is partial)."""
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back, partial characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix_text) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > 1024:  # drop ids that can no longer be in a window
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._parts.append(delta)
        return delta
