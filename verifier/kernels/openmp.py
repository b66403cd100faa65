"""Handing back the OpenMP worker threads of a thread that is done running the model.

torch's CPU ops and the C kernels run in parallel through libgomp, which keeps a pool of worker
threads for every host thread that ever started a parallel region. Once it manages more threads
than the machine has CPUs, it stops spinning at barriers (GOMP_SPINCOUNT's throttled count):
every join then sleeps and wakes through the kernel. The verifier's main thread loads the model,
in parallel torch ops, and the engine thread then runs every forward: two pools, each with a
thread per CPU, so every barrier sleeps and wakes and the engine thread's steps run much slower
than the loading thread's. Handing the loading thread's pool back (OpenMP 5.0's
omp_pause_resource_all) leaves no more threads than CPUs, and the steps run at full speed
(measured side by side: docs/benchmarks.md, "Figures behind design choices").
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep nothing else


@functools.cache  # one handle per process
def _libgomp() -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL("libgomp.so.1")  # the copy torch and the kernels already loaded
    except OSError:
        return None
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_thread_pool() -> bool:
    """Ends the calling thread's OpenMP worker threads (a later parallel region starts new ones).
    False where the runtime is not libgomp or predates OpenMP 5.0."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
