"""The engine's building thread hands its OpenMP workers back (verifier/openmp.py)."""

import os
import time

import pytest
import torch

from pardec.verifier.kernels.openmp import release_thread_pool


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_thread_done_with_the_model_hands_its_openmp_workers_back():
    torch.set_num_threads(2)
    torch.ones(4_000_000).sin_()  # big enough for a parallel region: this thread's pool has a worker
    before = thread_count()
    if not release_thread_pool():
        pytest.skip("the OpenMP runtime is not libgomp with OpenMP 5.0's omp_pause_resource_all")
    deadline = time.monotonic() + 5
    while thread_count() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread_count() < before
    torch.ones(4_000_000).sin_()  # and a later parallel region still runs, on a new pool
    assert thread_count() >= before
