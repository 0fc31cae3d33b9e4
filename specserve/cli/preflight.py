"""Checks of what the flags point at (files, directories, the port), before anything loads.

Value ranges are checked when the configs are built (specserve/config_flags.py); this module
checks the world: a model or draft path that does not exist, a chat template that does not
parse, a generation config that is not there, a port another process holds. Each failure is a
ValueError naming the flag. A string shaped like a Hugging Face repo id ("org/name") that is
not a local path is left to the engine, which looks it up in the local HF cache.
"""

from __future__ import annotations

import os
import re
import socket

from specserve.config import EngineConfig
from specserve.generation_config import load_generation_defaults
from specserve.models.presets import PRESETS

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _repo_shaped(value: str) -> bool:
    return bool(_REPO_ID.fullmatch(value)) and ".." not in value


def check_path(flag: str, value: str, what: str, needs: str | None = None) -> None:
    """`value` must exist (holding `needs`, when a directory) or look like a repo id."""
    if os.path.isdir(value):
        if needs and not os.path.isfile(os.path.join(value, needs)):
            raise ValueError(f"{flag} {value!r}: the directory holds no {needs}; pass {what}")
        return
    if os.path.exists(value) or _repo_shaped(value):
        return
    raise ValueError(
        f"{flag} {value!r}: no such file or directory; pass {what} (or a Hugging "
        "Face repo id in the local cache)"
    )


def check_engine_config(config: EngineConfig, dummy_ok: bool = False) -> None:
    """What an EngineConfig points at exists and parses (see the module docstring)."""
    preset = config.model in PRESETS and (config.load_format == "dummy" or dummy_ok)
    if not preset:
        check_path("--model", config.model, "a model directory or GGUF file")
    if config.tokenizer:
        check_path("--tokenizer", config.tokenizer, "a tokenizer directory")
    draft = config.spec.draft_model
    if config.spec.enabled and draft and draft != "dummy":  # mtp, ngram, suffix take none
        check_path("--spec-draft-model", draft, "an EAGLE-3 head directory", "config.json")
    if config.chat_template:
        from specserve.tokenizer import read_chat_template

        try:
            read_chat_template(config.chat_template)
        except ValueError as exc:
            raise ValueError(f"--chat-template {exc}") from None
    model_dir = config.model if os.path.isdir(config.model) else None
    try:
        load_generation_defaults(config.generation_config, model_dir)
    except ValueError as exc:
        raise ValueError(f"--generation-config {exc}") from None


def check_port(host: str, port: int) -> None:
    """The server can bind (host, port): the address resolves and no one listens there."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                "stop the process using it or pick another --port"
            ) from None
