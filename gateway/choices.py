"""A request for ``n`` sequences (OpenAI's ``n``), protobuf-free: n requests of one sequence
each, run side by side through the same `Generator`, their chunks merged as they are committed,
each with its sequence's index. The first prefills the prompt alone; the others find its blocks
in the verifier's prefix cache.

MindIE's rule holds: parallel decoding returns one sequence, so n > 1 is plain decoding's (each
copy carries ``n``, and the rules check it). With a seed, sequence i samples with seed + i: the
sequences differ, and the request is reproducible; greedy sequences are all the same.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Iterator

from pardec.gateway.deadlines import Cancelled, Deadline
from pardec.gateway.generation import Chunk, Generation, Generator, Request, joined

SEED_SPACE = 2**64  # the wire's seed is a uint64


def sequence_requests(request: Request) -> list[Request]:
    """One request per sequence."""
    if request.n <= 1:
        return [request]
    seed = request.sampling.seed
    return [dataclasses.replace(request, sampling=dataclasses.replace(
        request.sampling, seed=None if seed is None else (seed + index) % SEED_SPACE)) for index in range(request.n)]


def stream_sequences(generator: Generator, request: Request, deadline: Deadline) -> Iterator[tuple[int, Chunk]]:
    """(index, chunk) of each sequence as it is committed. The first error of any sequence is
    raised and ends the others; closing the iterator, or the deadline, ends every sequence and
    releases its sessions."""
    requests = sequence_requests(request)
    if len(requests) == 1:
        stream = generator.stream(request, deadline)
        try:
            for chunk in stream:
                yield 0, chunk
        finally:
            stream.close()  # at once, where the consumer stops early: it releases the sessions
        return
    arrived: queue.Queue = queue.Queue()
    stop = threading.Event()
    prefilled = threading.Event()  # the first sequence's prompt is in the verifier's prefix cache
    first_failed = threading.Event()

    def pump(index: int, stream: Iterator[Chunk]) -> None:
        try:
            for chunk in stream:
                prefilled.set()
                arrived.put((index, chunk, None))
                if stop.is_set():
                    break
            arrived.put((index, None, None))
        except BaseException as error:  # every way a sequence ends reaches the consumer
            if index == 0:
                first_failed.set()
            arrived.put((index, None, error))
        finally:
            prefilled.set()
            stream.close()  # releases the sequence's sessions, however it ended

    def start(index: int) -> None:
        threading.Thread(target=pump, args=(index, generator.stream(requests[index], deadline)), daemon=True,
                         name=f"sequence-{index}").start()

    def start_the_others() -> None:
        # The others start once the first has its first token: its prompt's blocks are then cached,
        # so theirs are found there, not computed n times over (vLLM's n shares the prefill too).
        prefilled.wait()
        for index in range(1, len(requests)):
            if stop.is_set() or first_failed.is_set() or deadline.cancelled:  # the request has ended
                arrived.put((index, None, Cancelled("the request ended before this sequence started")))
            else:
                start(index)

    start(0)
    threading.Thread(target=start_the_others, daemon=True, name="sequences").start()
    running = len(requests)
    ended = False
    try:
        while running:
            index, chunk, error = arrived.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
        ended = True
    finally:
        if not ended:  # the others stop at their next step, and release what they hold
            stop.set()
            deadline.cancel()


def generate_sequences(generator: Generator, request: Request, deadline: Deadline) -> list[Generation]:
    """Each sequence whole, in index order: its chunks joined, as `Generator.generate` joins one."""
    chunks: dict[int, list[Chunk]] = {}
    for index, chunk in stream_sequences(generator, request, deadline):
        chunks.setdefault(index, []).append(chunk)
    return [joined(chunks[index]) for index in sorted(chunks)]
