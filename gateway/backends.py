"""What the generation core drafts and verifies through, declared once so that the parts that
stand behind it stay interchangeable (tests/test_interfaces.py holds each to its protocol).

- DrafterBackend: a drafter replica over gRPC (clients.DrafterClient) or the drafter's core in
  this process (embedded_drafter.EmbeddedDrafter).
- VerifierBackend: one verifier replica (clients.VerifierClient) or several, with sessions that
  move when one fails (replicas.VerifierReplicas).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from pardec.gateway.deadlines import Deadline
    from pardec.runtime.draft_params import DraftParams
    from pardec.verifier.api import Prefilled, Sampling, Verification


class DrafterBackend(Protocol):
    """One drafting session per request: started beside the prefill, asked for a tree before
    each step, ended with the tokens it has not seen. Failures are PardecErrors."""

    def start_session(
        self, session_id: str, prompt: Sequence[int], params: DraftParams,
        client_session_id: str = "", shared_memory: str = "",
    ) -> Future:
        """Starts the session without waiting for it (`wait_started` does)."""
        ...

    def wait_started(self, started: Future, timeout_s: float | None = None) -> bool:
        """True once the session is started, False if it is still starting after ``timeout_s``."""
        ...

    def propose(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, accept probabilities) of the next tree, best first; within the
        propose timeout and what ``deadline`` (the request's) leaves. ``committed_length``: the
        tokens the session holds once ``new_tokens`` are in (prompt and every committed token;
        -1: not said), which makes a resent call record nothing twice (drafter/sessions.py)."""
        ...

    def propose_future(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> Future:
        """Propose without waiting for the answer (`proposal` reads it)."""
        ...

    def proposal(self, future: Future) -> tuple[list[int], list[int], list[float]]:
        """A `propose_future`'s tree."""
        ...

    def end_session(self, session_id: str, new_tokens: Sequence[int] = ()) -> None:
        """``new_tokens``: committed since the last Propose, for the session's memories."""
        ...

    def close(self) -> None:
        ...


class VerifierBackend(Protocol):
    """One verifier session per request: a prefill, a verify per step, a release. Prefill and
    verify end by ``deadline`` (the request's) and with its cancel: then DeadlineExceeded or
    Cancelled (gateway/deadlines.py). Release has its own timeout: a request past its deadline
    still frees its session."""

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, deadline: Deadline | None = None,
        max_new_tokens: int = 0, cache_scope: str = "", priority: int = 0, generated: int = 0,
    ) -> Prefilled:
        """Caches the prompt; returns the first generated token (and what the prefill took).
        ``cache_scope`` (the caller's tenant): who may share its cached prefix blocks.
        ``priority``: lower goes first where the verifier must choose between sessions.
        ``generated``: the last of ``tokens`` were generated already (a session resumed, a beam),
        so that only maxSeqLen bounds them, not maxInputTokenLen."""
        ...

    def verify(
        self, session_id: str, tokens: Sequence[int], parents: Sequence[int], deadline: Deadline | None = None
    ) -> Verification:
        """Verifies a tree under the session's root; commits the accepted path."""
        ...

    def release(self, session_id: str) -> None:
        ...

    def unavailable(self, timeout_s: float) -> str:
        """"" while the verifier can take sessions (a replica answers SERVING); else why not."""
        ...
