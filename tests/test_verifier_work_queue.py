"""How long the engine holds queued steps for other sessions to join a forward (pure logic, no
model): the wait counts from when the previous forward's results went out, not from the arrival
of a step that missed that forward."""

import threading
import time

from pardec.verifier.engine.batching import CallWork, WorkQueue


def _late(queue: WorkQueue, after_s: float) -> CallWork:
    work = CallWork(lambda: None)
    threading.Timer(after_s, queue.put, args=(work,)).start()
    return work


def _straggler(queue: WorkQueue, waited_s: float) -> CallWork:
    """A step that has been queued for `waited_s` already (it arrived while a forward ran)."""
    work = CallWork(lambda: None)
    work.arrived = time.monotonic() - waited_s
    queue.put(work)
    return work


def take(queue: WorkQueue, wait_s: float, not_before: float = 0.0, ready=lambda items: False):
    return queue.take(idle_timeout=1.0, busy=False, wait_s=wait_s, budget=512, ready=ready, not_before=not_before)


def test_a_step_that_missed_the_last_forward_waits_for_the_sessions_that_forward_served():
    queue = WorkQueue()
    straggler = _straggler(queue, waited_s=1.0)
    returning = _late(queue, after_s=0.05)  # a session just served, back after its gateway's work
    assert take(queue, wait_s=2.0, not_before=time.monotonic()) == [straggler, returning]


def test_counted_from_its_own_arrival_the_straggler_would_leave_alone():
    queue = WorkQueue()
    straggler = _straggler(queue, waited_s=1.0)
    returning = _late(queue, after_s=0.3)
    assert take(queue, wait_s=0.5) == [straggler]
    time.sleep(0.4)
    assert take(queue, wait_s=0.0) == [returning]


def test_no_wait_once_every_live_session_is_queued():
    queue = WorkQueue()
    work = _straggler(queue, waited_s=0.0)
    start = time.monotonic()
    assert take(queue, wait_s=30.0, not_before=start, ready=lambda items: True) == [work]
    assert time.monotonic() - start < 10.0  # far below the 30 s it would have waited


def test_the_wait_ends_at_its_deadline_when_nobody_comes():
    queue = WorkQueue()
    work = _straggler(queue, waited_s=0.0)
    start = time.monotonic()
    assert take(queue, wait_s=0.2, not_before=start) == [work]
    assert time.monotonic() - start >= 0.2
