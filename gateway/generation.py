"""The gateway's protobuf-free core: one request, driven draft → verify → commit."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from gateway.clients import DrafterClient, ModelInfo, Sampling, VerifierClient
from gateway.config import GatewayConfig
from pardec.errors import FailedPrecondition, InvalidArgument, PardecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int = 0  # 0 = the server's default
    plain: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 0
    best_of: int = 0
    use_beam_search: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    session_id: str = ""


# Request fields parallel decoding cannot honour (MindIE's constraints), one row each:
# (field as the client names it, accepted when, the rule in words).
REQUEST_RULES = (
    ("n", lambda r: r.n <= 1, "must be 0 or 1: parallel decoding returns one sequence"),
    ("best_of", lambda r: r.best_of <= 1, "must be 0 or 1: multi-sequence inference is not supported"),
    ("use_beam_search", lambda r: not r.use_beam_search, "beam search is not supported with parallel decoding"),
    ("logprobs", lambda r: not r.logprobs, "log-probabilities are not supported with parallel decoding"),
    ("top_logprobs", lambda r: r.top_logprobs == 0, "must be 0: log-probabilities are not supported"),
    ("sampling.presence_penalty", lambda r: r.presence_penalty == 0, "must be 0: only repetition_penalty is supported"),
    ("sampling.frequency_penalty", lambda r: r.frequency_penalty == 0, "must be 0: only repetition_penalty is supported"),
    ("stop", lambda r: all(r.stop), "stop strings must not be empty"),
)


@dataclass
class Stats:
    prompt_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    decoding_method: str = "plain"
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    drafter_ms: float = 0.0
    verifier_ms: float = 0.0
    verifier_compute_ms: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_draft_tokens / self.steps if self.steps else 0.0

    @property
    def gateway_ms(self) -> float:
        return max(0.0, self.total_ms - self.drafter_ms - self.verifier_ms)


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" | "eos"
    stats: Stats


class Generator:
    def __init__(self, config: GatewayConfig, verifier: VerifierClient, drafter: DrafterClient, model: ModelInfo):
        if config.draft is not None and config.draft.plugin_type != "memory_decoding":
            raise FailedPrecondition(
                f"plugin_type: {config.draft.plugin_type!r} is not implemented yet; use memory_decoding"
            )
        self.config = config
        self.verifier = verifier
        self.drafter = drafter
        self.model = model

    def generate(self, request: Request) -> Generation:
        started = time.perf_counter()
        for name, holds, rule in REQUEST_RULES:
            if not holds(request):
                raise InvalidArgument(f"{name}: {rule}")
        prompt_ids = self._prompt_tokens(request.prompt)
        max_new = request.max_new_tokens or self.config.default_max_new_tokens
        if len(prompt_ids) + max_new > self.model.max_seq_len:
            raise InvalidArgument(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new}) "
                f"exceeds maxSeqLen {self.model.max_seq_len}"
            )
        draft = None if request.plain else self.config.draft
        stats = Stats(prompt_tokens=len(prompt_ids), decoding_method=draft.plugin_type if draft else "plain")
        session_id = uuid.uuid4().hex
        decode = _Decoder(self.model, request.stop, max_new)
        try:
            clock = time.perf_counter()
            drafter_started = draft and self.drafter.start_session(session_id, prompt_ids, draft)
            first = self.verifier.prefill(session_id, prompt_ids, request.sampling)
            stats.verifier_ms += _ms_since(clock)
            if drafter_started:
                clock = time.perf_counter()
                self.drafter.wait_started(drafter_started)
                stats.drafter_ms += _ms_since(clock)
            stats.ttft_ms = _ms_since(started)
            new_tokens, node_argmax = [first], []
            while not decode.add(new_tokens):
                tokens, parents = [], []
                remaining = max_new - len(decode.tokens)
                if draft and remaining > 1:
                    clock = time.perf_counter()
                    tokens, parents = self.drafter.propose(
                        session_id, new_tokens, draft.tokens_per_step, remaining - 1, node_argmax
                    )
                    stats.drafter_ms += _ms_since(clock)
                clock = time.perf_counter()
                verified = self.verifier.verify(session_id, tokens, parents)
                stats.verifier_ms += _ms_since(clock)
                stats.verifier_compute_ms += verified.compute_ms
                stats.steps += 1
                stats.draft_tokens += len(tokens)
                stats.accepted_draft_tokens += len(verified.accepted_tokens)
                new_tokens = [*verified.accepted_tokens, verified.bonus_token]
                node_argmax = verified.node_argmax
        finally:
            self._release(session_id, draft is not None)
        stats.total_ms = _ms_since(started)
        return Generation(decode.text, decode.tokens, decode.finish_reason, stats)

    def _prompt_tokens(self, prompt: str) -> list[int]:
        if not prompt:
            raise InvalidArgument("prompt: must not be empty")
        ids = self.model.tokenizer.encode_chat(prompt)
        limit = self.config.max_input_tokens
        if len(ids) > limit:
            if not self.config.truncation:
                raise InvalidArgument(
                    f"prompt: {len(ids)} tokens exceed maxInputTokenLen {limit} (truncation is off)"
                )
            ids = ids[-limit:]  # keep the end: the question and the assistant header
        return ids

    def _release(self, session_id: str, drafted: bool) -> None:
        """Best effort: a failed release only leaves state that expires on its own."""
        cleanups = [self.verifier.release] + ([self.drafter.end_session] if drafted else [])
        for cleanup in cleanups:
            try:
                cleanup(session_id)
            except PardecError as error:
                log.warning("release of session %s failed: %s", session_id, error)


class _Decoder:
    """Accumulates committed tokens and decides when and where generation ends."""

    def __init__(self, model: ModelInfo, stop: tuple[str, ...], max_new: int):
        self._model = model
        self._stop = stop
        self._max_new = max_new
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason = ""

    def add(self, new_tokens: list[int]) -> bool:
        """Appends a step's tokens; True when generation is over (tokens and text final)."""
        base = len(self.tokens)
        for offset, token in enumerate(new_tokens):
            self.tokens.append(token)
            if token in self._model.stop_token_ids:
                self.finish_reason = "eos"
                break
            if len(self.tokens) >= self._max_new:
                self.finish_reason = "length"
                break
        self.text = self._model.tokenizer.decode(self.tokens)
        if self._stop and any(s in self.text for s in self._stop):
            self._cut_at_stop(base)
        return bool(self.finish_reason)

    def _cut_at_stop(self, base: int) -> None:
        # The first prefix of this step's tokens whose text holds a stop string ends it.
        for end in range(base + 1, len(self.tokens) + 1):
            text = self._model.tokenizer.decode(self.tokens[:end])
            hits = [text.find(s) for s in self._stop if s in text]
            if hits:
                self.tokens = self.tokens[:end]
                self.text = text[: min(hits)]
                self.finish_reason = "stop"
                return


def _ms_since(clock: float) -> float:
    return (time.perf_counter() - clock) * 1e3
