"""The next update's batch, built on the host while the device computes the current one.

A batch is a pure function of the step (the data order is seeded), so building update
``n + 1``'s rows ahead changes nothing but when they are ready. One background thread;
NumPy's indexing releases the GIL for the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``get(step)`` returns ``make(step)`` and starts building ``make(step + 1)``."""

    def __init__(self, make: Callable[[int], T]):
        self._make = make
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int) -> T:
        ahead, self._ahead = self._ahead, None
        # a step other than the one prepared (a restore, a repeated call) is built here
        value = ahead[1].result() if ahead is not None and ahead[0] == step else self._make(step)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._ahead = (step + 1, self._pool.submit(self._make, step + 1))
        return value
