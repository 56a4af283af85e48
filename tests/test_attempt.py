"""The phase of one upstream try (gateway.relay.attempt), without ASGI or a backend."""

from __future__ import annotations

import pytest

from gateway.errors import UpstreamUnavailable
from gateway.relay.attempt import Attempt, AttemptState, NextStep


def _attempt() -> Attempt:
    return Attempt(lease=object(), started=12.5)  # type: ignore[arg-type]


def test_a_new_attempt_has_sent_nothing() -> None:
    a = _attempt()
    assert a.state is AttemptState.NOT_SENT
    assert not a.abandoned and not a.launched
    assert a.next_step() is NextStep.STOP


def test_a_stream_goes_sent_launched_done() -> None:
    a = _attempt()
    a.sent()
    assert a.abandoned and not a.launched  # a long prefill: nothing came yet
    a.began(stream=True)
    assert a.abandoned and a.launched
    a.finished()
    assert a.state is AttemptState.DONE and not a.abandoned and not a.launched


def test_a_whole_answer_is_done_when_it_begins() -> None:
    a = _attempt()
    a.sent()
    a.began(stream=False)
    assert a.state is AttemptState.DONE and not a.abandoned


def test_a_finished_attempt_stays_finished() -> None:
    # A connection that never reached the backend is done before any answer begins.
    a = _attempt()
    a.sent()
    a.finished()
    a.began(stream=True)
    assert a.state is AttemptState.DONE and not a.abandoned


@pytest.mark.parametrize(("failed", "restart", "step"), [
    (False, False, NextStep.STOP),
    (False, True, NextStep.RESTART),
    (True, False, NextStep.FAIL_OVER),
    (True, True, NextStep.FAIL_OVER),  # another backend, rather than this one again
])
def test_the_retry_decision(failed: bool, restart: bool, step: NextStep) -> None:
    a = _attempt()
    a.failed = UpstreamUnavailable("down") if failed else None
    a.restart = restart
    assert a.next_step() is step


@pytest.mark.parametrize(("failed", "preempted", "restart", "step"), [
    (False, "pool_pressure", False, NextStep.RESUME),
    (False, "overflow", False, NextStep.RESUME),
    (False, "overflow", True, NextStep.RESUME),  # the tracked relay never restarts
    (True, "overflow", False, NextStep.FAIL_OVER),
])
def test_a_preempted_attempt_resumes(failed: bool, preempted: str, restart: bool,
                                     step: NextStep) -> None:
    a = _attempt()
    a.failed = UpstreamUnavailable("down") if failed else None
    a.preempted = preempted
    a.restart = restart
    assert a.next_step() is step
