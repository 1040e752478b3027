"""Calls made from several threads at once, for the tests that a second caller changes
no result."""

import threading
from collections.abc import Callable


def at_once(call: Callable[[int], None], threads: int, timeout: float) -> None:
    """``call(k)`` in ``threads`` threads started together (k = 0, 1, ...); fails where
    one still runs ``timeout`` seconds after its turn to be waited for."""
    started = [threading.Thread(target=call, args=(k,)) for k in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in started), "a thread still runs"
