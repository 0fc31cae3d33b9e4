"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A TP worker died or hung: the engine cannot run another step (restart it)."""
