"""When to speculate: a policy decides before each step is scheduled (torch-free).

The decision reaches the workers in StepInput.speculate; with it off, a step is the plain
step (decode graphs, no draft forward) and the scheduler reserves no lookahead for it. The
speculative worker catches the proposer up when speculation comes back (speculative/worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SpecPolicy(Protocol):
    def choose(self) -> bool:
        """Before scheduling a step: may it speculate?"""
        ...


class StaticPolicy:
    """Speculate on every step (the configured draft shape)."""

    def choose(self) -> bool:
        return True


class ScriptedPolicy:
    """A fixed on/off pattern, repeated step after step (switch-cost benchmarks, tests)."""

    def __init__(self, pattern: Sequence[bool]) -> None:
        if not pattern:
            raise ValueError("the pattern needs at least one step")
        self.pattern = [bool(p) for p in pattern]
        self.steps = 0

    def choose(self) -> bool:
        on = self.pattern[self.steps % len(self.pattern)]
        self.steps += 1
        return on
