"""When to speculate: a policy decides before each step is scheduled (torch-free).

The decision reaches the workers in StepInput.speculate; with it off, a step is the plain
step (decode graphs, no draft forward) and the scheduler reserves no lookahead for it. The
speculative worker catches the proposer up when speculation comes back (speculative/worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SpecPolicy(Protocol):
    def choose(self) -> str | None:
        """Before scheduling a step: the draft mode it runs (a DraftShape name), None: off."""
        ...


class StaticPolicy:
    """Speculate on every step with one mode (the configured draft shape)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def choose(self) -> str | None:
        return self.mode


class ScriptedPolicy:
    """A fixed pattern of modes (None: off), repeated step after step (switch-cost
    benchmarks, tests)."""

    def __init__(self, pattern: Sequence[str | None]) -> None:
        if not pattern:
            raise ValueError("the pattern needs at least one step")
        self.pattern = list(pattern)
        self.steps = 0

    def choose(self) -> str | None:
        mode = self.pattern[self.steps % len(self.pattern)]
        self.steps += 1
        return mode
