"""A request for ``n`` sequences (OpenAI's ``n``), protobuf-free: n requests of one sequence
each, run side by side through the same `Generator`, their chunks merged as they are committed,
each with its sequence's index. The first prefills the prompt alone; the others find its blocks
in the verifier's prefix cache.

MindIE's rule holds: parallel decoding returns one sequence, so n > 1 is plain decoding's (each
copy carries ``n``, and the rules check it). With a seed, sequence i samples with seed + i: the
sequences differ, and the request is reproducible; greedy sequences are all the same. With
``use_beam_search`` the n sequences are the n best beams instead (gateway/beam_search.py).
"""

from __future__ import annotations

import dataclasses
import queue
import re
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Iterator

from pardec.gateway.beam_search import admitted, beam_search
from pardec.gateway.deadlines import Cancelled, Deadline
from pardec.gateway.generation import Generator, Request
from pardec.gateway.outputs import Chunk, Generation, joined
from pardec.gateway.rules import bounded_sequences
from pardec.runtime.errors import PardecError

SEED_SPACE = 2**64  # the wire's seed is a uint64


def sequence_requests(request: Request) -> list[Request]:
    """One request per sequence; an n past the rules' bound is refused before any copy is made (a
    fuzzed n of 2**32 - 1 once filled the memory)."""
    if bounded_sequences(request.n) <= 1:
        return [request]
    seed = request.sampling.seed
    return [dataclasses.replace(request, sampling=dataclasses.replace(
        request.sampling, seed=None if seed is None else (seed + index) % SEED_SPACE)) for index in range(request.n)]


def prompt_named(error: PardecError, index: int) -> PardecError:
    """``error`` naming the batch's prompt it is about (``prompt[2]``), where it names the prompt
    (or one of its token ids: ``prompt[2][5]``).

    >>> from pardec.runtime.errors import InvalidArgument
    >>> str(prompt_named(InvalidArgument("prompt: too long"), 2)), str(prompt_named(InvalidArgument("prompt_logprobs: x"), 2))
    ('prompt[2]: too long', 'prompt_logprobs: x')
    >>> str(prompt_named(InvalidArgument("prompt_token_ids[5]: 99999 is not a token"), 2))
    'prompt[2][5]: 99999 is not a token'
    """
    message = str(error)
    named = re.match(r"prompt\b(?!\[)|prompt_token_ids(?=\[)", message)
    if not named:
        return error
    return error.reworded(f"prompt[{index}]{message[named.end():]}")


def stream_sequences(generator: Generator, requests: Request | list[Request],
                     deadline: Deadline) -> Iterator[tuple[int, Chunk]]:
    """(index, chunk) of each sequence as it is committed: the n sequences of each of ``requests``
    (a batch of prompts, or one), numbered prompt by prompt. The first error of any sequence is
    raised and ends the others; closing the iterator, or the deadline, ends every sequence and
    releases its sessions. A prompt's first sequence starts at once, its others once it has its
    first token: the prompt's blocks are then in the verifier's prefix cache, so theirs are found
    there, not computed n times over (vLLM's n shares the prefill too)."""
    batch = [requests] if isinstance(requests, Request) else requests
    if batch[0].use_beam_search:  # every prompt's request asks the same but for its prompt
        yield from _beams(generator, batch, deadline)
        return
    groups = [sequence_requests(request) for request in batch]
    sequences = [sequence for group in groups for sequence in group]
    if len(sequences) > 1:  # each one's log line and span say which it is
        sequences = [dataclasses.replace(sequence, sequence=index) for index, sequence in enumerate(sequences)]
    if len(sequences) == 1:
        stream = generator.stream(sequences[0], deadline)
        try:
            for chunk in stream:
                yield 0, chunk
        finally:
            stream.close()  # at once, where the consumer stops early: it releases the sessions
        return
    arrived: queue.Queue = queue.Queue()
    stop = threading.Event()

    def pump(index: int, followers: range) -> None:
        stream, waiting = generator.stream(sequences[index], deadline), bool(followers)

        def release(ended: bool) -> None:  # starts the followers, or tells the consumer they never will
            nonlocal waiting
            if not waiting:
                return
            waiting = False
            for follower in followers:
                if ended or stop.is_set() or deadline.cancelled:
                    arrived.put((follower, None, Cancelled("the request ended before this sequence started")))
                else:
                    start(follower, range(0))

        try:
            for chunk in stream:
                arrived.put((index, chunk, None))
                release(False)
                if stop.is_set():
                    break
            release(False)
            arrived.put((index, None, None))
        except BaseException as error:  # every way a sequence ends reaches the consumer, its own error first
            arrived.put((index, None, error))
            release(True)
        finally:
            stream.close()  # releases the sequence's sessions, however it ended

    def start(index: int, followers: range) -> None:
        threading.Thread(target=pump, args=(index, followers), daemon=True, name=f"sequence-{index}").start()

    first = 0
    for group in groups:
        start(first, range(first + 1, first + len(group)))
        first += len(group)
    running = len(sequences)
    prompts = [index for index, group in enumerate(groups) for _ in group]  # each sequence's prompt
    ended = False
    try:
        while running:
            index, chunk, error = arrived.get()
            if error is not None:
                raise prompt_named(error, prompts[index]) if len(groups) > 1 else error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
        ended = True
    finally:
        if not ended:  # the others stop at their next step, and release what they hold
            stop.set()
            deadline.cancel()


def _beams(generator: Generator, batch: list[Request], deadline: Deadline) -> Iterator[tuple[int, Chunk]]:
    """Beam search's answers (gateway/beam_search.py) at index prompt × n + rank (the best beam
    first), each prompt's whole as its search ends. Every prompt is checked before any search
    starts, and a batch's prompts are searched side by side."""
    width = max(1, bounded_sequences(batch[0].n))
    batch = [dataclasses.replace(request, sequence=number if len(batch) > 1 else None)
             for number, request in enumerate(batch)]
    checked = []
    for number, request in enumerate(batch):
        try:
            checked.append(admitted(generator, request))
        except PardecError as error:
            if len(batch) > 1:
                raise prompt_named(error, number) from None
            raise
    with ThreadPoolExecutor(len(batch), thread_name_prefix="beam-search") as pool:
        searches = {pool.submit(beam_search, generator, request, deadline, checked[number]): number
                    for number, request in enumerate(batch)}
        ended = False
        try:
            for done in as_completed(searches):
                number = searches[done]
                try:
                    generations = done.result()
                except PardecError as error:
                    if len(batch) > 1:
                        raise prompt_named(error, number) from None
                    raise
                for rank, generation in enumerate(generations):
                    yield number * width + rank, Chunk(generation.text, generation.token_ids,
                                                       generation.finish_reason, generation.stats,
                                                       prompt_tokens=generation.stats.prompt_tokens,
                                                       cached_tokens=generation.stats.cached_prompt_tokens)
            ended = True
        finally:
            if not ended:  # what still searches stops at its next round
                deadline.cancel()


def generate_sequences(generator: Generator, requests: Request | list[Request],
                       deadline: Deadline) -> list[Generation]:
    """Each sequence whole, in index order: its chunks joined, as `Generator.generate` joins one."""
    chunks: dict[int, list[Chunk]] = {}
    for index, chunk in stream_sequences(generator, requests, deadline):
        chunks.setdefault(index, []).append(chunk)
    return [joined(chunks[index]) for index in sorted(chunks)]
