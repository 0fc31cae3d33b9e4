"""The bundled default model: a tiny Python-code target and its EAGLE-3 head."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL_NAME = "specserve-tiny-code"


def default_model_path() -> str:
    path = ASSETS / "tiny-code"
    if not (path / "config.json").is_file():
        raise ValueError(f"the bundled default model is missing at {path}; pass --model PATH")
    return str(path)


def default_draft_path() -> str | None:
    """The EAGLE-3 head bundled with the default model, if present."""
    path = ASSETS / "tiny-code-eagle3"
    return str(path) if (path / "config.json").is_file() else None
