"""The OpenAI error envelope, and what a client's values may appear in a message.

Every refusal is an `APIError`: {"error": {message, type, param, code}} with an HTTP status.
Messages say what to change and quote a client's values shortened (`echo`, ~100 characters);
a message is capped as a backstop. Pydantic validation errors become a 400 naming the field.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

from pydantic import ValidationError

# What a union-typed field accepts, for messages clearer than pydantic's per-branch ones.
_EXPECTED = {
    "prompt": "a string or a list of token ids (integers)",
    "stop": "a string or a list of strings",
}
# Pydantic union tags that can appear inside an error location; they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


MAX_ECHO_CHARS = 100  # of a client's value quoted in an error message
MAX_MESSAGE_CHARS = 400  # of any error message (a backstop: values are echoed shortened)


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """A client's value quoted for an error message, at most ~limit characters (never the
    whole of a large value: reprlib stops early)."""
    text = _ECHO_REPR.repr(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    if isinstance(value, str) and len(value) > limit:
        text += f" ({len(value)} characters)"
    return text


_ECHO_REPR = reprlib.Repr()
_ECHO_REPR.maxlevel, _ECHO_REPR.maxdict, _ECHO_REPR.maxlist = 3, 6, 6
_ECHO_REPR.maxstring = _ECHO_REPR.maxother = MAX_ECHO_CHARS


class APIError(Exception):
    """An error answered with the OpenAI envelope {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None, code: str | int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union tags such as 'list[int]' dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part.startswith("function-"):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: ValidationError | Any) -> APIError:
    """Turn a pydantic (or FastAPI) validation error into a 400 naming the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes body fields with "body"
        loc = loc[1:]
    param = _loc_to_param(loc)
    kind = str(first.get("type", ""))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "model_type" or (not loc and "dictionary" in msg):
        return bad_request("the request body must be a JSON object")
    if param in _EXPECTED and kind.endswith("_type"):
        msg = f"{param} must be {_EXPECTED[param]}"
    elif param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    if kind != "missing" and "input" in first and "got" not in msg:
        msg += f", got {_short(first['input'])}"
    return bad_request(msg, param)


def _short(value: Any) -> str:
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    text = json.dumps(value) if isinstance(value, (str, int, float, list, dict)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
