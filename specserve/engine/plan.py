"""What the scheduler plans for one step (torch-free): the scheduled entries, the preempted
requests and the release lists the workers act on."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.request import Request


class QueueFullError(Exception):
    """The waiting queue is at config.max_waiting; retry later (the server answers 429)."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # run tokens all_token_ids[start : start + num_new_tokens]
    start: int  # = request.num_computed_tokens when scheduled
    lookahead: int = 0  # KV slots owned past start + num_new_tokens (decode entries only)
    is_decode: bool = False
    # the KV of [0, start) came from the prefix cache at this admission (target and draft)
    from_cache: bool = False
    _num_tokens: int = field(init=False, repr=False)  # request.num_tokens when scheduled

    def __post_init__(self) -> None:
        self._num_tokens = self.request.num_tokens

    @property
    def samples(self) -> bool:
        """The runner samples a token: the chunk reaches the request's newest token."""
        return self.start + self.num_new_tokens == self._num_tokens

    @property
    def cost(self) -> int:
        """Tokens of the step's budget this entry uses."""
        return self.num_new_tokens + self.lookahead


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    preempted: list[Request]
    # requests that left the running set by finishing or aborting since the last schedule:
    # the workers drop their per-request state (preempted ones are listed above)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Budgeted tokens: new tokens plus decode lookahead slots."""
        return sum(e.cost for e in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepPlan:
    """A schedule in the making: its entries, preemptions and budget spent."""

    entries: dict[str, ScheduledRequest] = field(default_factory=dict)  # by request_id
    preempted: list[Request] = field(default_factory=list)
    used: int = 0  # budget spent
