"""A request body's JSON, parsed strictly: application/json only, valid UTF-8 (no lone
surrogate), no NaN / Infinity, bounded nesting, list fields capped before validation; fields
no request shape defines are logged once per name (`warn_ignored`)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from specserve.server.errors import bad_request, echo

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
log = logging.getLogger(__name__)
_WARNED_FIELDS: set[str] = set()  # unknown request fields already logged (bounded)
MAX_WARNED_FIELDS = 256


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON; send finite numbers")


def parse_request_json(body: bytes, content_type: str,
                       limits: dict[str, tuple[int, str]]) -> Any:
    """The JSON value of a request body (strict: no NaN, valid UTF-8), list fields capped."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise bad_request(
            f"Content-Type must be application/json, got "
            f"{echo(content_type) if content_type else 'none'}"
        )
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
        if _SURROGATE_ESCAPE.search(body):  # a lone surrogate needs a \ud800-style escape
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeError:
        raise bad_request(
            "the request body is not valid UTF-8 / Unicode (a lone surrogate?); "
            "send valid UTF-8 JSON"
        ) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    _check_list_lengths(obj, limits)
    return obj


def _check_list_lengths(obj: Any, limits: dict[str, tuple[int, str]]) -> None:
    if not isinstance(obj, dict):
        return  # validation names the problem
    for field, (cap, why) in limits.items():
        outer, _, inner = field.partition("[].")
        items = obj.get(outer)
        if not isinstance(items, list):
            continue
        lists = (
            [(outer, items)]
            if not inner
            else [
                (f"{outer}[{i}].{inner}", item.get(inner))
                for i, item in enumerate(items)
                if isinstance(item, dict) and isinstance(item.get(inner), list)
            ]
        )
        for name, value in lists:
            if len(value) > cap:
                raise bad_request(
                    f"{name} holds {len(value)} items; at most {cap} are accepted ({why})", name
                )


def warn_ignored(names: set[str]) -> None:
    """Fields a request carries that no OpenAI or vLLM shape here defines are ignored (clients
    send extras); the log says so once per field name, so nothing is dropped silently."""
    new = sorted(n for n in names if n not in _WARNED_FIELDS)
    if not new or len(_WARNED_FIELDS) >= MAX_WARNED_FIELDS:
        return
    _WARNED_FIELDS.update(new)
    log.warning("request field(s) %s not used by this server: ignored (logged once per name)",
                ", ".join(echo(n, 40) for n in new[:8]))
