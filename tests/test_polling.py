"""poll_until: the one deadline loop (real time, small timeouts)."""

from __future__ import annotations

import time

import pytest

from kvshrink.testing.polling import poll_until


class Counter:
    """A predicate that turns truthy (returns ``value``) on call number ``ready_on``."""

    def __init__(self, ready_on: int, value: object = "ready") -> None:
        self.calls = 0
        self.ready_on = ready_on
        self.value = value

    def __call__(self) -> object:
        self.calls += 1
        return self.value if self.calls >= self.ready_on else None


def test_returns_the_first_truthy_value() -> None:
    predicate = Counter(ready_on=3, value={"chunks": 4})
    assert poll_until(predicate, 5.0, interval=0.01) == {"chunks": 4}
    assert predicate.calls == 3


def test_raises_the_given_error_naming_what_was_awaited() -> None:
    predicate = Counter(ready_on=10**9)
    start = time.monotonic()
    with pytest.raises(AssertionError, match="the store to go quiet after 0 s"):
        poll_until(predicate, 0.1, interval=0.01, what="the store to go quiet", error=AssertionError)
    assert time.monotonic() - start >= 0.1
    assert predicate.calls >= 2


def test_default_error_is_timeout_error() -> None:
    with pytest.raises(TimeoutError, match="condition"):
        poll_until(lambda: 0, 0.05, interval=0.01)


def test_error_may_be_a_factory_that_adds_late_detail() -> None:
    with pytest.raises(RuntimeError, match=r"waiting for vllm .*\nlog tail"):
        poll_until(lambda: False, 0.02, interval=0.01, what="vllm",
                   error=lambda message: RuntimeError(f"{message}\nlog tail"))


def test_timeout_zero_still_calls_the_predicate_once() -> None:
    never = Counter(ready_on=10**9)
    with pytest.raises(TimeoutError):
        poll_until(never, 0, interval=0.01)
    assert never.calls == 1
    assert poll_until(Counter(ready_on=1), 0) == "ready"


def test_checks_once_more_at_the_deadline_instead_of_oversleeping() -> None:
    """An interval longer than the timeout: the second check happens at the deadline, and passes."""
    predicate = Counter(ready_on=2)
    start = time.monotonic()
    assert poll_until(predicate, 0.1, interval=30.0) == "ready"
    assert 0.1 <= time.monotonic() - start < 5.0
    assert predicate.calls == 2


def test_an_exception_from_the_predicate_propagates_unchanged() -> None:
    boom = ValueError("status endpoint returned garbage")

    def predicate() -> bool:
        raise boom

    with pytest.raises(ValueError) as caught:
        poll_until(predicate, 5.0, interval=0.01, error=AssertionError)
    assert caught.value is boom
