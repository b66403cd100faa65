"""Several verifier replicas behind one gateway, and sessions that survive losing one.

A session's KV cache lives on the replica that prefilled it, so its calls stick there (no
round robin). A new session goes to the least busy replica, or to one whose prefix cache likely
holds the start of its prompt: a conversation's earlier turn, a shared system prompt
(prefix_affinity.py). The gateway records what the session has committed (prompt + generated tokens);
when its replica stops answering (UNAVAILABLE, a missed deadline) or no longer knows it
(NOT_FOUND after a restart), the session is rebuilt on another replica by one resume prefill of
prompt + committed tokens. That prefill's next token is exactly what a plain decoding step would
produce there, so the failed step becomes a plain step and the text is unchanged (greedy; with
sampling the draw comes from a freshly seeded generator, so the text is identically distributed
but a seeded request is no longer reproducible across the move).

A replica that misses a verify's timeout may still hold the session, busy or not: it is asked to
release it, and the resume prefills under a new key, so a resume that lands on that same replica
(the only one, or the only one left) never meets the session it replaces. A verify cut short by
the request's own deadline or cancel is no fault of the replica: it ends the request
(DeadlineExceeded, Cancelled), and nothing moves.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pardec.gateway.clients import ModelInfo, VerifierClient
from pardec.gateway.deadlines import Deadline, TimedOut
from pardec.gateway.prefix_affinity import PrefixAffinity
from pardec.runtime.errors import ConfigError, NotFound, PardecError, ResourceExhausted, Unavailable
from pardec.verifier.api import Prefilled, Sampling, Verification

log = logging.getLogger(__name__)

# How long a replica that failed is skipped for new sessions (it may be restarting).
DOWN_FOR_S = 5.0
# How long a replica not yet compared with replica 0 has to say what it serves before a session.
CHECK_WAIT_S = 2.0


@dataclass
class _Placement:
    replica: int
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)  # prompt + every committed token
    key: str = ""  # the session's id on its replica: a new one after each move
    moves: int = 0
    # The most tokens the request may still generate past the prompt (0: not said); the replica
    # promises the session room for them up front.
    max_new_tokens: int = 0
    prompt_tokens: int = 0
    cache_scope: str = ""  # who may share its cached prefix blocks (the tenant)
    priority: int = 0  # the request's, on every replica it is placed on


class VerifierReplicas:
    """A VerifierBackend (backends.py) over one or more replicas (``targets``: "host:port,...")."""

    def __init__(
        self, clients: Sequence[VerifierClient], on_failover: Callable[[str], None] = lambda reason: None,
        down_for_s: float = DOWN_FOR_S,
    ):
        if not clients:
            raise ConfigError("verifier: at least one replica address is needed")
        self._clients = list(clients)
        self._on_failover = on_failover
        self._down_for_s = down_for_s
        self._down_until = [0.0] * len(clients)
        self._sessions: dict[str, _Placement] = {}
        self._lock = threading.Lock()
        # Replica 0's model (model_info), and the replicas not compared with it since they were
        # last down or forgot a session (a restart may have changed their settings).
        self._reference: ModelInfo | None = None
        self._unchecked: set[int] = set()
        # Where a new session's prompt start was served before (prefix_affinity.py); known once
        # model_info says the replicas' prefix cache block, and only with a choice to make.
        self._affinity: PrefixAffinity | None = None

    @classmethod
    def connect(cls, targets: str, timeout_s: float, tls=None, **kwargs) -> "VerifierReplicas":
        addresses = [t.strip() for t in targets.removeprefix("ipv4:").split(",") if t.strip()]
        return cls([VerifierClient(address, timeout_s, tls) for address in addresses], **kwargs)

    def unavailable(self, timeout_s: float) -> str:
        """"" while some replica answers SERVING, lets this gateway in and serves its model (a
        session goes to one that does); else what each said."""
        said = []
        for index, client in enumerate(self._clients):
            why = client.unavailable(timeout_s)
            if not why:
                try:  # an authorized call, unlike the health check, and what it serves
                    brief = client.model_info(timeout_s, brief=True)
                    why = self._reference and _mismatch(self._reference, brief, index, warn=False) or ""
                except PardecError as error:
                    why = f"{client.target}: {error}"
            if not why:
                return ""
            said.append(why)
        return "no verifier replica serves: " + "; ".join(said)

    def model_info(self, wait_s: float) -> ModelInfo:
        """The first replica's model (waiting up to ``wait_s`` for it); every other replica
        that answers must serve the same model with the same numerics (ConfigError); one that does
        not answer is compared before it takes its first session (_admissible)."""
        info = self._clients[0].model_info(wait_s)
        self._reference = info
        for index, client in enumerate(self._clients[1:], start=1):
            try:
                other = client.model_info(wait_s)
            except PardecError as error:
                log.warning("verifier replica %d not reachable at startup: %s", index, error)
                self._unchecked.add(index)
                continue
            why = _mismatch(info, other, index)
            if why:
                raise ConfigError(why)
        if len(self._clients) > 1 and info.prefix_block_tokens:
            self._affinity = PrefixAffinity(len(self._clients), info.prefix_block_tokens)
        return dataclasses.replace(info, verifier_replicas=len(self._clients))

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, deadline: Deadline | None = None,
        max_new_tokens: int = 0, cache_scope: str = "", priority: int = 0, generated: int = 0,
    ) -> Prefilled:
        placement = _Placement(-1, sampling, list(tokens), key=session_id, max_new_tokens=max_new_tokens,
                               prompt_tokens=len(tokens) - generated, cache_scope=cache_scope, priority=priority)
        # Known before the call, so that a prefill the client cancels midway is released too.
        with self._lock:
            self._sessions[session_id] = placement
        first = self._place(session_id, placement, resume=bool(generated), deadline=deadline)
        placement.tokens.append(first.token)
        return first

    def verify(
        self, session_id: str, tokens: Sequence[int], parents: Sequence[int], deadline: Deadline | None = None
    ) -> Verification:
        placement = self._placement(session_id)
        client = self._clients[placement.replica]
        try:
            verified = client.verify(placement.key, tokens, parents, deadline)
        except (Unavailable, NotFound) as error:
            reason = "lost_session" if isinstance(error, NotFound) else "unavailable"
            with self._lock:
                self._unchecked.add(placement.replica)  # it restarted, or will: compared again before use
            if isinstance(error, Unavailable):
                self._mark_down(placement.replica)
                client.release_later(placement.key)  # it may still hold the session
            log.warning("verifier replica %d: %s; resuming session %s", placement.replica, error, session_id)
            self._on_failover(reason)
            clock = time.perf_counter()
            placement.moves += 1
            placement.key = f"{session_id}.{placement.moves}"
            # Prompt + committed, this step's root included: the token after them is the one a
            # plain step would give, and it is the root of the next tree.
            resumed = self._place(session_id, placement, resume=True, deadline=deadline)
            verified = Verification([], resumed.token, [], (time.perf_counter() - clock) * 1e3,
                                    logprobs=[resumed.logprob] if resumed.logprob is not None else [])
        placement.tokens.extend([*verified.accepted_tokens, verified.bonus_token])
        return verified

    def release(self, session_id: str) -> None:
        with self._lock:
            placement = self._sessions.pop(session_id, None)
        if placement is not None and placement.replica >= 0:
            self._clients[placement.replica].release(placement.key)
            if self._affinity is not None:  # the replica keeps the blocks of all but the root
                self._affinity.served(placement.replica, placement.tokens[:-1], placement.cache_scope)

    def _placement(self, session_id: str) -> _Placement:
        with self._lock:
            placement = self._sessions.get(session_id)
        if placement is None:
            raise NotFound(f"session_id: {session_id} has no verifier session on this gateway")
        return placement

    def _place(
        self, session_id: str, placement: _Placement, resume: bool, deadline: Deadline | None = None
    ) -> Prefilled:
        """Prefills ``placement.tokens`` on the least loaded healthy replica, the others in turn
        if it is down or full; its answer holds the token that follows them."""
        last_error: PardecError | None = None
        for replica in self._candidates(placement.replica if resume else -1, placement):
            if not self._admissible(replica):
                last_error = last_error or Unavailable(f"verifier: replica {replica} differs from replica 0")
                continue
            placement.replica = replica  # where a prefill cut short by the client is released
            client = self._clients[replica]
            try:
                generated = len(placement.tokens) - placement.prompt_tokens
                left = max(1, placement.max_new_tokens - generated) if placement.max_new_tokens else 0
                # A resumed session's tokens are not the caller's prompt: nothing of them to score.
                # The verifier counts min_tokens from, and matches a structured output past, the
                # tokens generated so far.
                sampling = placement.sampling
                if resume:
                    sampling = dataclasses.replace(sampling, prompt_logprobs=None)
                prefilled = client.prefill(placement.key, placement.tokens, sampling, deadline, resume=resume,
                                           max_new_tokens=left, cache_scope=placement.cache_scope,
                                           generated=generated if resume else 0, priority=placement.priority)
            except Unavailable as error:
                self._mark_down(replica)
                if isinstance(error, TimedOut):  # it may finish the prefill later: free it there
                    client.release_later(placement.key)
                last_error = error
                continue
            except ResourceExhausted as error:
                last_error = error
                continue
            if self._affinity is not None:
                self._affinity.served(replica, placement.tokens, placement.cache_scope)
            return prefilled
        if isinstance(last_error, ResourceExhausted):
            raise last_error
        raise Unavailable(f"verifier: no replica could take session {session_id}: {last_error}")

    def _candidates(self, exclude: int, session: _Placement) -> list[int]:
        """Healthy replicas, least sessions first, but first of all the one whose prefix cache
        likely holds the longest start of ``session``'s tokens (unless much busier); replicas marked
        down come last, ``exclude`` (the one that just failed) only when nothing else is left."""
        now = time.monotonic()
        with self._lock:
            load = [0] * len(self._clients)
            for placement in self._sessions.values():
                if placement.replica >= 0:
                    load[placement.replica] += 1
        order = sorted(range(len(self._clients)), key=lambda r: (r == exclude, self._down_until[r] > now, load[r], r))
        if self._affinity is not None:
            healthy = [r for r in order if r != exclude and self._down_until[r] <= now]
            cached = self._affinity.choose(healthy, load, session.tokens, session.cache_scope)
            if cached is not None:
                order.remove(cached)
                order.insert(0, cached)
        return order

    def _admissible(self, replica: int) -> bool:
        """Whether ``replica`` may take a session: compared with replica 0 first where it has not
        been since it was last down; one that differs (or does not answer) is marked down."""
        with self._lock:
            if replica not in self._unchecked or self._reference is None:
                return True
        try:
            why = _mismatch(self._reference, self._clients[replica].model_info(CHECK_WAIT_S), replica)
        except PardecError as error:
            why = f"verifier: replica {replica} did not say what it serves: {error}"
        if why:
            log.error("%s: it takes no sessions for now", why)
            self._mark_down(replica)
            return False
        with self._lock:
            self._unchecked.discard(replica)
        return True

    def _mark_down(self, replica: int) -> None:
        with self._lock:
            self._unchecked.add(replica)
        self._down_until[replica] = time.monotonic() + self._down_for_s
        if self._affinity is not None:
            self._affinity.forget(replica)


def _mismatch(reference: ModelInfo, other: ModelInfo, index: int, warn: bool = True) -> str | None:
    """Why replica ``index`` (``other``) cannot take replica 0's sessions, or None: a session moved
    between replicas must get the same logits, so the same model and the same numerics. ``warn``:
    log a replica that does not name its numerics (not every health check)."""
    if (other.model_name, other.quantization) != (reference.model_name, reference.quantization):
        return (f"verifier: replica {index} serves {other.model_name} ({other.quantization}), replica 0 "
                f"{reference.model_name} ({reference.quantization}); all replicas must serve the same model")
    for numerics in ("attention", "kv_cache_dtype", "embedding_rounding"):
        ours, theirs = getattr(reference, numerics), getattr(other, numerics)
        if not ours or not theirs:  # an older verifier does not say: nothing to compare
            if warn:
                log.warning("verifier: replica %d or 0 does not name its %s (an older verifier)", index, numerics)
        elif ours != theirs:
            return (f"verifier: replica {index} runs {numerics} {theirs!r}, replica 0 {ours!r}; a session moved "
                    "between them would change its tokens")
    return None
