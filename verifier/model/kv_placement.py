"""Where a new run of KV blocks goes in the pool (kvcache.KVPool.allocate): a pure function of
the free blocks and of the room the sessions already there may still grow into.

Sessions grow upwards, so a session placed `room` blocks below the top of a free run has all of
its growth bounded by the neighbour above, which was there first; the next goes below it. So
sessions pack down from the pool's top, and the pages the OS commits for the pool (torch.empty
reserves, first writes commit) follow the most the sessions ever held at once, not how long the
pool has served: placing each in the middle of the largest free run, as before, spread them over
the whole pool in the end.

Worked example, blocks 0..9 free and nobody's growth room:

>>> place(set(range(10)), set(), count=2, room=4)  # a session of 2 blocks that may grow to 4
[6, 7]

Its room is now blocks 8 and 9; a session of 3 that may grow to 3 goes below it:

>>> place(set(range(6)) | {8, 9}, {8, 9}, count=3, room=3)
[3, 4, 5]
"""

from __future__ import annotations


def place(free: set[int], growth_room: set[int], count: int, room: int) -> list[int]:
    """`count` blocks for a session that may grow to `room`: at the top of the highest free run
    that holds `room` blocks outside everyone's growth room, else among all free blocks, else
    at the start of the largest free run, else the highest free blocks (a scattered session)."""
    room = max(room, count)
    for runs in (free_runs(free - growth_room), free_runs(free)):
        for start, length in reversed(runs):
            if length >= room:
                first = start + length - room
                return list(range(first, first + count))
    start, length = max(free_runs(free), key=lambda run: (run[1], run[0]))
    if length >= count:
        return list(range(start, start + count))
    return sorted(free)[-count:]


def free_runs(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive blocks as (start, length), lowest first.

    >>> free_runs({0, 1, 2, 5, 7, 8})
    [(0, 3), (5, 1), (7, 2)]
    """
    runs: list[tuple[int, int]] = []
    for block in sorted(free):
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs
