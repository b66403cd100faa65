"""The preparation's independent pieces of work (a GPTQ chunk of output channels, one rotated
matrix, a block of a vocabulary's rows) run side by side on a pool of threads.

The preparation runs every op on one thread, so that replicas with any number of threads prepare
the same bits (loading.py). Pieces that share nothing but their inputs can still run at once: each
on a thread of its own, each op inside it single-threaded, each writing its own result. A piece
computes the same numbers on any thread, in any order, beside any others, so the result is the
same bits for a pool of any size, one thread included (tests/test_prepare_streaming.py).

    >>> with Workers(3) as workers:
    ...     workers.map(lambda x: x * x, [1, 2, 3, 4])
    [1, 4, 9, 16]
    >>> Workers(1).map(str, [5])  # one worker: in the calling thread, no pool
    ['5']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

Item, Result = TypeVar("Item"), TypeVar("Result")


def _thread_start() -> None:
    """A new thread takes the process's intra-op thread count (1 while preparing) now: until its
    first element-wise op it would run a matrix product on OpenMP's default, every core."""
    torch.set_num_threads(torch.get_num_threads())


class Workers:
    """``count`` threads (1: the calling thread alone). A piece must not itself wait on this pool."""

    def __init__(self, count: int = 1):
        self.count = max(1, int(count))
        self._pool = ThreadPoolExecutor(self.count, thread_name_prefix="prepare", initializer=_thread_start) \
            if self.count > 1 else None

    def map(self, work: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
        """work(item) for every item, in the items' order; the first error is raised."""
        if self._pool is None:
            return [work(item) for item in items]

        def piece(item: Item) -> Result:
            with torch.no_grad():  # autograd's mode is per thread
                return work(item)

        return list(self._pool.map(piece, items))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


ONE = Workers(1)  # the default: every piece in turn, on the calling thread
