"""What the verifier's servicer serves through: one Engine (engine.py), or Workers over one
Engine per device (devices.py). Declared once here so that either can stand behind the servicer
and a test can hold both to it (tests/test_interfaces.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from pardec.verifier.api import Prefilled, Sampling, Verification
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.model.tokenizer import ChatTokenizer
    from pardec.verifier.model.transformer import Transformer


class ServingEngine(Protocol):
    """Sessions of one model: the model's description for GetModelInfo and the three calls."""

    model: Transformer
    tokenizer: ChatTokenizer
    model_name: str
    config: VerifierConfig
    cost_curve: list[tuple[int, int, float]]  # (tokens, batch, step_ms), see costcurve.py

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, seed: int | None, resume: bool = False,
        max_new_tokens: int = 0, cache_scope: str = "", generated: int = 0, priority: int = 0,
    ) -> Prefilled:
        """Caches the prompt; the first generated token, compute ms, cached tokens. ``max_new_tokens`` (0: not
        said): admission promises the session room for them up front. ``cache_scope``: who may
        share its cached prefix blocks. ``generated``: with ``resume``, how many of the tokens,
        the last ones, were generated before. ``priority``: lower goes first where the engine
        must choose between sessions."""
        ...

    def verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]) -> Verification:
        """One forward over the session's root and the tree; commits the accepted path."""
        ...

    def release(self, session_id: str) -> bool:
        """Frees a session; False when there was none."""
        ...

    def close(self) -> None:
        """Stops serving; calls still queued fail UNAVAILABLE."""
        ...
