"""The speculation policy's protocol and the policies that learn nothing: one mode on every
step (StaticPolicy) or a fixed pattern of modes (ScriptedPolicy: switch-cost benchmarks,
tests). engine/spec_policy.py holds the adaptive one and re-exports these (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SpecPolicy(Protocol):
    needs_batch: bool  # choose() reads the ids of the requests about to decode

    def choose(self, decoding: list[str], others: int = 0,
               behind: int = 0) -> str | bool | None:
        """Before scheduling a step: the draft mode it runs (a DraftShape name; True: the
        configured one), None or False: off. decoding: ids of the running requests about to
        decode ([] unless needs_batch); others: the requests prefilling or waiting; behind:
        positions of the decoding requests their drafters' state does not cover (what a
        catch-up runs the target over when they speculate again)."""
        ...

    def fold(self, mode: str, decoding: list[str]) -> bool:
        """A step of `mode` that carries prefill chunks beside the decodes `decoding`: True
        runs the decodes one token each in the chunks' forward (feeding the drafter) rather
        than a verify forward beside it."""
        ...

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None, chain_runs: dict | None = None) -> None:
        """After a step: per speculating request the drafts it accepted; the step's wall time
        (None: not measured) with `batch` decode rows; mixed: prefill chunks ran in it too
        (chunk_tokens of them, when known); folded: fold() said so for it; chain_runs: a
        tree's cycle's per request (StepOutput.chain_runs): what the same drafter's chains learn."""
        ...

    def forget(self, request_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """A request finished (the prompt tokens it prefilled, the tokens it made) or was
        aborted."""
        ...


class _Fixed:
    """A policy that learns nothing."""

    needs_batch = False

    def fold(self, mode: str, decoding: list[str]) -> bool:
        return False

    def observe(self, mode: str | None, accepted: dict[str, int], seconds: float | None,
                batch: int, mixed: bool = False, folded: bool = False,
                chunk_tokens: int | None = None, chain_runs: dict | None = None) -> None:
        pass

    def forget(self, request_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        pass


class StaticPolicy(_Fixed):
    """Speculate on every step with one mode (the configured draft shape)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def choose(self, decoding: list[str], others: int = 0, behind: int = 0) -> str | None:
        return self.mode


class ScriptedPolicy(_Fixed):
    """A fixed pattern of modes (True: the configured one; None or False: off), repeated
    step after step (switch-cost benchmarks, tests)."""

    def __init__(self, pattern: Sequence[str | bool | None]) -> None:
        if not pattern:
            raise ValueError("the pattern needs at least one step")
        self.pattern = list(pattern)
        self.steps = 0

    def choose(self, decoding: list[str], others: int = 0,
               behind: int = 0) -> str | bool | None:
        mode = self.pattern[self.steps % len(self.pattern)]
        self.steps += 1
        return mode
