"""The draft -> verify -> commit loop of every benchmark that drives a verifier itself, greedy.

The gateway's own loop (gateway/generation.py's Generator) also sizes trees to the load, governs
drafting and decodes text through a gRPC verifier; the benchmarks that measure a drafter or the
verifier alone need the bare loop, over the Engine in their own process or over gRPC, and one
loop keeps what they count (tokens, steps, draft nodes) counted alike.

A verifier here is anything with the Engine's calls minus its sampling arguments: `InProcess`
(an Engine) or `OverGrpc` (the gateway's VerifierClient). A drafter has `start`, `propose`,
`observe` and `end` (`Drafter`); none decodes plain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class Drafter(Protocol):
    def start(self, prompt_ids: list[int]) -> None:
        """Before the prefill."""

    def propose(self, new_tokens: list[int], node_argmax: list[int], max_depth: int) -> tuple[list[int], list[int]]:
        """The tree to verify: ``new_tokens`` are what the previous step made (the prefill's
        token first), ``node_argmax`` what it returned per node, ``max_depth`` the room left."""

    def observe(self, verified, nodes: int) -> None:
        """After each step: its verification and how many draft nodes it verified."""

    def end(self, last_tokens: list[int]) -> None:
        """After the session is released: what the last step made, which no propose carried."""


class InProcess:
    """An Engine of this process, greedy."""

    def __init__(self, engine):
        from pardec.verifier.api import Sampling

        self.engine, self._sampling = engine, Sampling()

    def prefill(self, session_id: str, prompt_ids: Sequence[int]) -> tuple[int, float]:
        prefilled = self.engine.prefill(session_id, prompt_ids, self._sampling, None)
        return prefilled.token, prefilled.compute_ms

    def verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]):
        return self.engine.verify(session_id, tokens, parents)

    def release(self, session_id: str) -> None:
        self.engine.release(session_id)


class OverGrpc(InProcess):
    """A verifier server through the gateway's client, greedy."""

    def __init__(self, client):
        from pardec.verifier.api import Sampling

        self.engine, self._sampling = client, Sampling()

    def prefill(self, session_id: str, prompt_ids: Sequence[int]) -> tuple[int, float]:
        prefilled = self.engine.prefill(session_id, prompt_ids, self._sampling)
        return prefilled.token, prefilled.compute_ms


def commit(output: list[int], new_tokens, max_new: int, stops) -> None:
    """Appends a step's tokens to `output`, up to `max_new` tokens and the first stop token."""
    for token in new_tokens:
        if len(output) < max_new and output[-1] not in stops:
            output.append(token)


@dataclass
class Decoded:
    """One request's output and counts."""

    output: list[int]  # the prefill's token, then what the steps committed
    steps: int = 0
    nodes: int = 0  # draft tokens verified, accepted or not
    accepted: int = 0  # draft tokens accepted
    compute_ms: float = 0.0  # the verifier's own, prefill included
    decode_s: float = 0.0  # wall time of the steps, after the prefill
    last_tokens: list[int] = field(default_factory=list)  # what the last step made

    @property
    def produced(self) -> int:
        """Tokens the steps made, those past max_new or a stop token included."""
        return self.steps + self.accepted


class Decode:
    """One greedy session: ``prefill``, ``run`` until ``max_new`` tokens (the prefill's counted)
    or a stop token, ``release``; split so that a benchmark can hold sessions between the phases
    (bench/verifier_batching.py lines up all its sessions' decoding). ``decode`` runs all three."""

    def __init__(self, verifier, session_id: str, prompt_ids: list[int], max_new: int, stops=(),
                 drafter: Drafter | None = None):
        self.verifier, self.session_id, self.prompt_ids = verifier, session_id, prompt_ids
        self.max_new, self.stops, self.drafter = max_new, stops, drafter
        self.result = Decoded([])
        self._argmax: list[int] = []

    def prefill(self) -> Decoded:
        if self.drafter is not None:
            self.drafter.start(self.prompt_ids)
        first, compute_ms = self.verifier.prefill(self.session_id, self.prompt_ids)
        self.result = Decoded([first], compute_ms=compute_ms, last_tokens=[first])
        return self.result

    @property
    def done(self) -> bool:
        output = self.result.output
        return len(output) >= self.max_new or output[-1] in self.stops

    def step(self) -> None:
        result, tokens, parents = self.result, [], []
        if self.drafter is not None:
            tokens, parents = self.drafter.propose(result.last_tokens, self._argmax,
                                                   self.max_new - len(result.output) - 1)
        verified = self.verifier.verify(self.session_id, tokens, parents)
        if self.drafter is not None:
            self.drafter.observe(verified, len(tokens))
        result.steps, result.nodes = result.steps + 1, result.nodes + len(tokens)
        result.accepted += len(verified.accepted_tokens)
        result.compute_ms += verified.compute_ms
        result.last_tokens, self._argmax = [*verified.accepted_tokens, verified.bonus_token], verified.node_argmax
        commit(result.output, result.last_tokens, self.max_new, self.stops)

    def run(self) -> Decoded:
        start = time.perf_counter()
        while not self.done:
            self.step()
        self.result.decode_s += time.perf_counter() - start
        return self.result

    def release(self) -> None:
        """The verifier's session, then the drafter's."""
        try:
            self.verifier.release(self.session_id)
        finally:
            if self.drafter is not None:
                self.drafter.end(self.result.last_tokens)


def decode(verifier, session_id: str, prompt_ids: list[int], max_new: int, stops=(),
           drafter: Drafter | None = None) -> Decoded:
    """Prefill, steps and release of one session (released also when a step fails)."""
    session = Decode(verifier, session_id, prompt_ids, max_new, stops, drafter)
    try:
        session.prefill()
        return session.run()
    finally:
        session.release()
