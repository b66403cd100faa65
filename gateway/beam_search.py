"""Beam search (vLLM's ``use_beam_search``), plain decoding's: MindIE refuses it with parallel
decoding, and a beam's next token is read, not drafted.

``width`` beams (the request's ``n``) grow a token a round. Each live beam's next-token
distribution comes from the verifier, the round's beams side by side so that it batches them: a
one-token step of the parent's session where the beam took its parent's likeliest token, else a
prefill of the prompt and the beam's tokens in a new session (the verifier's prefix cache holds
their shared blocks). Each beam's ``candidates`` likeliest
tokens extend it, and the ``width`` best extensions by cumulative log-probability live on; an
extension by an end token (the model's end of sequence, a stop token id) is a finished beam.
After max_new_tokens rounds the live beams finish too, and the ``width`` best finished beams by
`score` (cumulative log-probability over the sequence's length, prompt included and the end token
not, to the power ``length_penalty``: vLLM's) are the answers, best first. The log-probabilities
are the model's raw ones: temperature, top-k and top-p do not apply, as in vLLM.

A round, as `extend` takes it (log-probabilities in binary fractions, so the sums print exactly):

    >>> live, ended = extend([Beam(())], [[(5, -0.25), (2, -0.5), (7, -2.0)]], width=2, ends={2})
    >>> live, ended
    ([Beam(tokens=(5,), logprob=-0.25, ended=False), Beam(tokens=(7,), logprob=-2.0, ended=False)], \
[Beam(tokens=(2,), logprob=-0.5, ended=True)])
    >>> live, ended = extend(live, [[(6, -0.25), (2, -0.5)], [(8, -0.125)]], width=2, ends={2})
    >>> [(beam.tokens, beam.logprob) for beam in live], [(beam.tokens, beam.logprob) for beam in ended]
    ([((5, 6), -0.5), ((7, 8), -2.125)], [((5, 2), -0.75)])
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pardec.gateway.deadlines import Deadline
from pardec.gateway.decoding import StreamDecoder, text_tokenizer
from pardec.gateway.outputs import Generation, Stats
from pardec.runtime.errors import InvalidArgument, PardecError
from pardec.verifier.api import MAX_LOGPROBS, Sampling

NextTokens = Callable[[list[tuple[int, ...]]], list[Sequence[tuple[int, float]]]]


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated, the end token included where it ended
    logprob: float = 0.0  # the sum of its tokens' log-probabilities
    ended: bool = False  # by an end token (else it is live, or was cut at max_new_tokens)


def candidates(width: int) -> int:
    """How many of each beam's likeliest next tokens are tried: twice the width (vLLM's), so that
    ``width`` extensions remain where end tokens are among them; at most MAX_LOGPROBS."""
    return min(MAX_LOGPROBS, 2 * width)


def extend(beams: Sequence[Beam], nexts: Sequence[Iterable[tuple[int, float]]], width: int,
           ends: frozenset[int] | set[int]) -> tuple[list[Beam], list[Beam]]:
    """One round: (the ``width`` best live extensions, best first; the extensions that ended)."""
    live, ended = [], []
    for beam, choices in zip(beams, nexts):
        for token, logprob in choices:
            grown = Beam((*beam.tokens, token), beam.logprob + logprob, token in ends)
            (ended if grown.ended else live).append(grown)
    live.sort(key=lambda beam: beam.logprob, reverse=True)  # stable: ties keep the beams' order
    return live[:width], ended


def score(beam: Beam, prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's: the cumulative log-probability over the sequence's length to ``length_penalty``."""
    length = prompt_tokens + len(beam.tokens) - beam.ended
    return beam.logprob / max(length, 1) ** length_penalty


def _rank(beam: Beam, prompt_tokens: int, length_penalty: float) -> float:
    """`score`'s order without its overflow: the logarithm of -score, negated (a score of 0,
    every token certain, ranks first); a length_penalty of 1e30 would overflow ``length ** 1e30``."""
    if beam.logprob >= 0:
        return math.inf
    length = max(prompt_tokens + len(beam.tokens) - beam.ended, 1)
    return length_penalty * math.log(length) - math.log(-beam.logprob)


def best(beams: Iterable[Beam], width: int, prompt_tokens: int, length_penalty: float) -> list[Beam]:
    return sorted(beams, key=lambda beam: _rank(beam, prompt_tokens, length_penalty), reverse=True)[:width]


def search(next_tokens: NextTokens, width: int, max_new: int, ends: frozenset[int], prompt_tokens: int,
           length_penalty: float) -> list[Beam]:
    """The ``width`` best beams, best first; ``next_tokens`` gives each live beam's candidates."""
    live, finished = [Beam(())], []
    for _ in range(max_new):
        if not live:
            break
        live, ended = extend(live, next_tokens([beam.tokens for beam in live]), width, ends)
        finished = best([*finished, *ended], width, prompt_tokens, length_penalty)  # the rest can never win
    return best([*finished, *live], width, prompt_tokens, length_penalty)


def admitted(generator, request) -> tuple[object, list[int], int]:
    """``request`` as beam search runs it, its prompt's tokens and max_new_tokens; refused here
    (the rules) if beam search cannot honour it."""
    sampling = generator.answers.constrained(request)
    if sampling.structured_output is not None and request.sampling.structured_output is None:
        raise InvalidArgument("tool_choice: a required tool call is held to its arguments' grammar, which "
                              "use_beam_search cannot honour (its beams are ranked by raw log-probabilities)")
    request = dataclasses.replace(request, sampling=sampling)
    prompt_ids, max_new, _ = generator.admit(request)
    return request, prompt_ids, max_new


def beam_search(generator, request, deadline: Deadline, checked: tuple | None = None) -> list[Generation]:
    """``request``'s n best beams as generations, best first (gateway/generation.py's Generator
    serves them; the rules refuse what beam search cannot honour). ``checked``: what `admitted`
    already said of it."""
    started = time.perf_counter()
    span, stats, failure = generator.reports.begin(deadline, request.tenant, request.sequence), None, None
    beams: list[Beam] = []
    generator.enter()  # its prefills load the verifier as any request's steps do
    try:
        request, prompt_ids, max_new = checked or admitted(generator, request)
        width = max(1, request.n)
        model = generator.model
        eos = frozenset() if request.ignore_eos else model.stop_token_ids
        ends = eos | frozenset(request.stop_token_ids)
        stats = Stats(prompt_tokens=len(prompt_ids), decoding_method="beam_search")
        asked = Sampling(logprobs=candidates(width))  # greedy: the raw distribution, its likeliest first
        sessions = _Sessions(generator, request, prompt_ids, asked, deadline, span)
        with ThreadPoolExecutor(2 * width, thread_name_prefix="beam") as pool:  # a round's steps, and releases
            def round_of(sequences: list[tuple[int, ...]]) -> list[Sequence[tuple[int, float]]]:
                deadline.check()
                clock = time.perf_counter()
                answers = sessions.round(pool, sequences)
                # The round's steps share the verifier's forwards: its wall time, its longest forward.
                stats.verifier_ms += (time.perf_counter() - clock) * 1e3
                stats.verifier_compute_ms += max(compute for _, compute, _ in answers)
                stats.steps += 1
                return [top for top, _, _ in answers]

            try:
                beams = search(round_of, width, max_new, ends, len(prompt_ids), request.length_penalty)
            finally:
                sessions.release_all()
        stats.cached_prompt_tokens = sessions.cached_prompt_tokens
        stats.total_ms = stats.ttft_ms = (time.perf_counter() - started) * 1e3  # nothing is sent before the end
        generations = [_generation(beam, request, eos, max_new, model.tokenizer, stats) for beam in beams]
        metrics = generator.metrics  # the request's figures once, each beam's finish
        metrics.ttft.observe(stats.ttft_ms / 1e3)
        metrics.finished(stats, sum(len(generation.token_ids) for generation in generations), decoded=False)
        for generation in generations:
            metrics.count_finish(generation.finish_reason)
        return generations
    except BaseException as error:
        failure = error
        raise
    finally:
        generator.leave()
        span.end({"gen_ai.response.model": generator.model.model_name, "pardec.beams": len(beams),
                  "gen_ai.request.max_tokens": request.max_new_tokens, "gen_ai.latency.e2e": (
                      time.time_ns() - deadline.arrived_ns) / 1e9,
                  **(stats.span_attributes(len(beams[0].tokens) if beams else 0) if stats else {})}, failure)


class _Sessions:
    """The verifier sessions a search's live beams hold between rounds. A session's root (the
    verifier's next token, not yet in its cache) is its beam's likeliest next token, so a beam
    extended by it continues in its parent's session with a one-token step, as plain decoding
    does; any other extension (and the first round) is a prefill of a new session, the prefix
    cache holding its common blocks (a session's blocks are findable as they fill). A parent's
    session goes to its first such child; the sessions no beam continues are released beside the
    next round's steps."""

    def __init__(self, generator, request, prompt_ids: list[int], asked: Sampling, deadline: Deadline, span):
        self.generator, self.request, self.prompt_ids = generator, request, prompt_ids
        self.asked, self.deadline, self.span = asked, deadline, span
        self.held: dict[tuple[int, ...], tuple[str, int]] = {}  # a live beam's tokens: (session, root)
        self.cached_prompt_tokens = 0

    def plan(self, sequences: list[tuple[int, ...]]) -> tuple[list[tuple[str, int] | None], list[str]]:
        """Which session each sequence continues (None: a prefill), and the sessions none does."""
        plans, taken = [], set()
        for tokens in sequences:
            parent = self.held.get(tokens[:-1]) if tokens else None
            if parent is not None and parent[1] == tokens[-1] and parent[0] not in taken:
                taken.add(parent[0])
                plans.append(parent)
            else:
                plans.append(None)
        dropped = [session for session, _ in self.held.values() if session not in taken]
        self.held = {}
        return plans, dropped

    def round(self, pool: ThreadPoolExecutor, sequences: list[tuple[int, ...]]
              ) -> list[tuple[Sequence[tuple[int, float]], float, tuple[str, int]]]:
        """Every sequence's `next_tokens`, side by side with the releases of the sessions no beam
        continues; the sessions they hold are then held (all released where one failed)."""
        plans, dropped = self.plan(sequences)
        releases = [pool.submit(_release, self.generator.verifier, session) for session in dropped]
        futures = [pool.submit(self.next_tokens, tokens, plan) for tokens, plan in zip(sequences, plans)]
        wait([*futures, *releases])
        failed = next((future.exception() for future in futures if future.exception() is not None), None)
        if failed is not None:
            for future in futures:
                if future.exception() is None:
                    _release(self.generator.verifier, future.result()[2][0])
            raise failed
        answers = [future.result() for future in futures]
        self.held = {tokens: held for tokens, (_, _, held) in zip(sequences, answers)}
        return answers

    def next_tokens(self, tokens: tuple[int, ...], plan: tuple[str, int] | None
                    ) -> tuple[Sequence[tuple[int, float]], float, tuple[str, int]]:
        """The beam's candidates, the verifier's compute ms, and the session it now holds."""
        verifier, request = self.generator.verifier, self.request
        if plan is not None:
            session = plan[0]
            try:
                with self.span.current():
                    verified = verifier.verify(session, [], [], self.deadline)
            except BaseException:
                _release(verifier, session)
                raise
            return verified.logprobs[-1].top, verified.compute_ms, (session, verified.bonus_token)
        session = f"beam-{uuid.uuid4().hex}"
        try:
            with self.span.current(), self.generator.prefilling():  # a child span; a prefill to the governor
                # Past the first round the beam's tokens are generated ones: maxSeqLen bounds them, not
                # maxInputTokenLen. Room is promised for one token: a session continued grows as it goes,
                # so that n beams do not hold n answers' room up front.
                prefilled = verifier.prefill(
                    session, [*self.prompt_ids, *tokens], self.asked, self.deadline,
                    max_new_tokens=1, cache_scope=request.cache_scope,
                    priority=request.priority, generated=len(tokens))
        except BaseException:
            _release(verifier, session)
            raise
        if not tokens:
            self.cached_prompt_tokens = prefilled.cached_tokens
        top = prefilled.logprob.top if prefilled.logprob is not None else ((prefilled.token, 0.0),)
        return top, prefilled.compute_ms, (session, prefilled.token)

    def release_all(self) -> None:
        for session, _ in self.held.values():
            _release(self.generator.verifier, session)
        self.held = {}


def _release(verifier, session: str) -> None:
    try:
        verifier.release(session)
    except PardecError:
        pass  # a session left behind expires on its own


def _generation(beam: Beam, request, eos: frozenset[int], max_new: int, tokenizer, stats: Stats) -> Generation:
    """The beam's answer as a stream of it would say it: its text, and why it ended."""
    decoder = StreamDecoder(text_tokenizer(tokenizer, request.keep_special_tokens), eos, (), max_new,
                            frozenset(request.stop_token_ids), request.include_stop_str_in_output)
    piece = decoder.add(list(beam.tokens))  # the first piece: all of it, once done
    return Generation(piece.text, list(piece.token_ids), decoder.finish_reason or "length", dataclasses.replace(stats))
