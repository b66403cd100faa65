"""Giving the C heap's free pages back to the system once a load has let go of its copies.

Loading a model frees many float copies of a few to a few tens of MB each. glibc serves blocks of
that size from its heap (its threshold for memory-mapping a block rises to 32 MB once such blocks
are freed) and keeps freed heap pages for reuse, so without a trim a process goes on holding
hundreds of MB (GBs for a 1B model) that it will never touch again. `malloc_trim(0)` returns the
free pages of every arena. Elsewhere than glibc it is not there, and nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    trim = _trim()
    if trim is not None:
        trim(0)
