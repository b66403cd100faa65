"""Whether the gateway can serve, said where load balancers look: a thread asks the verifier
replicas every ``interval_s`` (their grpc.health.v1, and where SERVING, a brief GetModelInfo: the
health service is open to anyone, that call tells whether the replica lets this gateway in and
serves its model: gateway/replicas.py), and while none passes, two checks
in a row, the gateway's own health reports NOT_SERVING (grpc.health.v1 on its port) and its HTTP
API's GET /health answers 503 (what the replicas said goes to the log: the probe is open to
anyone), as TGI's /health checks its model shards and vLLM's its engine. A load balancer or a Kubernetes readiness probe thus stops sending requests
that could only be refused; once a replica serves again, so does the gateway. Drafters are not
asked: without them the gateway decodes plain."""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 1.0  # one replica's answer, however often they are asked
FAILURES_TO_STOP = 2  # checks in a row that no replica passes before the gateway stops serving: one slow answer is none


class BackendWatch:
    """Asks ``verifier`` (``unavailable(timeout_s) -> str``, "" while it serves) every
    ``interval_s`` until ``stop`` or while ``alive()``; ``on_change(serving)`` is told each change.
    ``unavailable`` is what it last said ("" at first: the gateway starts once its verifier answered)."""

    def __init__(self, verifier, interval_s: float, on_change: Callable[[bool], None],
                 alive: Callable[[], bool] = lambda: True):
        self._verifier, self.interval_s, self._on_change, self._alive = verifier, interval_s, on_change, alive
        self.unavailable = ""
        self._failures = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s) and self._alive():
            try:
                why = self._verifier.unavailable(CHECK_TIMEOUT_S)
            except Exception as error:  # the watch goes on whatever one check met
                why = f"the verifiers' health could not be asked: {type(error).__name__}: {error}"
            self._failures = self._failures + 1 if why else 0
            if why and self._failures < FAILURES_TO_STOP:
                continue
            if bool(why) != bool(self.unavailable) and not self._stopped.is_set():
                if why:
                    log.warning("not serving: %s", why)
                else:
                    log.info("serving again: a verifier replica answers")
                self._on_change(not why)
            self.unavailable = why

    def stop(self) -> None:
        """Ends the watch; from now on the gateway says it does not serve (it is shutting down)."""
        self.unavailable = "the gateway is shutting down"
        self._stopped.set()
        self._thread.join(CHECK_TIMEOUT_S * 4 + self.interval_s)
