"""Wait for a condition by polling it until a deadline.

Servers, stores and engines we drive finish their work in the background and expose no event to
wait on, so tests, benchmarks and launchers poll. Writing that loop once keeps the timeout rules the
same everywhere: the condition is always checked at least once and once more at the deadline (a
slow machine that gets there just in time is not failed), and the error names what was awaited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(predicate: Callable[[], T], timeout: float, *, interval: float = 0.25, what: str = "condition",
               error: Callable[[str], Exception] = TimeoutError) -> T:
    """Call ``predicate()`` every ``interval`` seconds until it returns a truthy value, and return it.

    After ``timeout`` seconds raise ``error(message)``; ``error`` is an exception class or any
    callable that builds the exception from the message (to add what is known only at that moment,
    such as a log tail). Exceptions raised by ``predicate`` propagate unchanged.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise error(f"timed out waiting for {what} after {timeout:.0f} s")
        time.sleep(min(interval, remaining))
