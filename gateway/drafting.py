"""One request's drafting, which can slow a request down but never fail it or change its output.

Drafts only propose: the verifier keeps exactly what the model itself would produce, with or
without a tree. So a drafter that is down, slow (misses ``propose_timeout_s``) or lost its Redis
just means that step runs with an empty tree, a plain step. After a failure the drafter is left
alone for ``drafter_retry_s`` (a dead one then costs nothing per step), and the tokens it missed
are sent with the next call, so its n-gram memory has no gap when it is back. A session the
drafter no longer knows (Redis restarted, state expired) ends drafting for the request.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from gateway.clients import DrafterClient
from gateway.config import DraftParams, GatewayConfig
from pardec.errors import NotFound, PardecError

log = logging.getLogger(__name__)


class DraftSession:
    def __init__(
        self, client: DrafterClient, session_id: str, params: DraftParams, config: GatewayConfig,
        on_fallback: Callable[[str], None] = lambda reason: None,
    ):
        self._client = client
        self._session_id = session_id
        self.params = params
        self._retry_s = config.drafter_retry_s
        self._propose_timeout = config.propose_timeout_s
        self._waited = False
        self._on_fallback = on_fallback
        self._started: Future | None = None
        self._pending: list[int] = []  # committed tokens the drafter has not recorded yet
        self._retry_at = 0.0
        self.active = True  # False: no more drafting for this request
        self.opened = False  # StartSession was sent, so EndSession is owed

    def start(self, prompt: Sequence[int], client_session_id: str = "", shared_memory: str = "") -> None:
        """Sends StartSession without waiting, so that it overlaps the verifier's prefill."""
        self.opened = True
        self._started = self._client.start_session(
            self._session_id, prompt, self.params, client_session_id, shared_memory
        )

    def propose(
        self, new_tokens: Sequence[int], max_nodes: int, max_depth: int, last_node_argmax: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """The next tree, or an empty one when drafting is off, resting or failing right now."""
        self._pending.extend(new_tokens)
        if not self.active or max_nodes <= 0 or max_depth <= 0 or time.monotonic() < self._retry_at:
            return [], []
        if not self._session_ready():
            return [], []
        try:
            tree = self._client.propose(self._session_id, self._pending, max_nodes, max_depth, last_node_argmax)
        except NotFound as error:
            self._stop("lost_session", error)
            return [], []
        except PardecError as error:
            # Possibly recorded anyway (an answer lost after the deadline): a duplicated n-gram
            # only skews drafts, never the output, so the tokens are sent again.
            self._retry_at = time.monotonic() + self._retry_s
            self._on_fallback("propose")
            log.warning("drafter: %s; plain steps for %.1fs", error, self._retry_s)
            return [], []
        self._pending = []
        return tree

    def _session_ready(self) -> bool:
        """StartSession overlaps prefill; the first step waits for it at most one propose
        deadline, later steps not at all (they run plain until it is done)."""
        if self._started is None:
            return True
        try:
            ready = self._client.wait_started(self._started, 0 if self._waited else self._propose_timeout)
        except PardecError as error:
            self._stop("start", error)
            return False
        self._waited = True
        if ready:
            self._started = None
        return ready

    def end(self) -> None:
        if self.opened:
            self._client.end_session(self._session_id)

    def _stop(self, reason: str, error: PardecError) -> None:
        self.active = False
        self._on_fallback(reason)
        log.warning("drafter: %s; plain decoding for the rest of session %s", error, self._session_id)
