"""What decode overlap asks of the scheduler: whether prefill chunks follow a step
(expects_prefill), and prefill put off one step behind decodes launched ahead
(defer_prefill). The engine side is in tests/test_overlap.py."""

from __future__ import annotations

from scheduler_helpers import make, req, step


def test_expects_prefill_foresees_the_next_steps_chunks() -> None:
    """What decode overlap asks before launching the next decode ahead: a prompt not done
    after this step, or a waiting request that a slot (once the rows reaching max_tokens
    end) and free pages would admit."""
    s = make(budget=8, seqs=2, pages=64)
    s.add(req("a", 20))
    out = s.schedule()
    assert s.expects_prefill(out)  # a's prompt goes on next step
    s.update(out, [[]])
    out = s.schedule()
    s.update(out, [[]])
    out = s.schedule()  # a's last chunk
    assert not s.expects_prefill(out)
    s.update(out, [[7]])
    s.add(req("b", 3, max_tokens=3))
    step(s)  # b prefilled: a and b decode, both slots taken
    s.add(req("c", 3))
    out = s.schedule()
    assert not s.expects_prefill(out)  # c waits for a slot nobody frees this step
    s.update(out, [[7], [7]])
    out = s.schedule()  # b's third token ends it: its slot frees, c is admitted next step
    assert not out.preempted and s.expects_prefill(out)
    # a slot but no pages for the first chunk: nothing would be admitted
    t = make(budget=16, seqs=4, pages=6)
    t.add(req("x", 8, max_tokens=4))
    step(t)
    t.add(req("y", 12, max_tokens=4))
    out = t.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["x"] and t.waiting
    assert not t.expects_prefill(out)


def test_deferred_prefill_waits_one_step_only() -> None:
    """defer_prefill (the decodes were launched ahead): the step runs the decodes only and
    expects_prefill says prefill is due, so the engine (which defers after a step it let
    launch ahead, i.e. one expects_prefill said no prefill follows) does not defer the next;
    with no decode to run nothing waits."""
    s = make(budget=16, seqs=4)
    s.add(req("a", 3))
    out = s.schedule(defer_prefill=True)  # no decodes: the prompt runs
    assert [e.request.request_id for e in out.scheduled] == ["a"] and not s.deferred
    s.update(out, [[7]])
    s.add(req("b", 5))
    out = s.schedule(defer_prefill=True)
    assert [e.request.request_id for e in out.scheduled] == ["a"] and s.deferred
    assert s.expects_prefill(out)
    s.update(out, [[7]])
    out = s.schedule(defer_prefill=not s.expects_prefill(out))  # the engine's rule
    assert [e.request.request_id for e in out.scheduled] == ["a", "b"] and not s.deferred
