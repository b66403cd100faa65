"""What a generation gives back (Generator.stream, Generator.generate): each step's `Chunk`, the
whole `Generation` (the chunks `joined`, so the unary answer and the concatenated stream are equal
by construction), and its `Stats`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pardec.verifier.api import TokenLogprob


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
    cached_prompt_tokens: int = 0  # the prompt's tokens the verifier found in its prefix cache
    prediction_tokens: int = 0  # the request's prediction's tokens (gateway/prediction.py), 0 without one
    accepted_prediction_tokens: int = 0  # of them, those that appeared in the answer

    def count_step(self, draft_tokens: int, accepted: int, compute_ms: float) -> None:
        """A verify step: the tree's draft tokens, those accepted, and its forward's time."""
        self.steps += 1
        self.draft_tokens += draft_tokens
        self.accepted_draft_tokens += accepted
        self.verifier_compute_ms += compute_ms

    @property
    def rejected_prediction_tokens(self) -> int:
        return self.prediction_tokens - self.accepted_prediction_tokens

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_draft_tokens / self.steps if self.steps else 0.0

    @property
    def gateway_ms(self) -> float:
        return max(0.0, self.total_ms - self.drafter_ms - self.verifier_ms)

    def span_attributes(self, completion_tokens: int) -> dict[str, object]:
        """What a request's trace span says of it (runtime/tracing.py names them)."""
        return {
            "gen_ai.usage.prompt_tokens": self.prompt_tokens, "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.latency.time_to_first_token": self.ttft_ms / 1e3, "pardec.decoding_method": self.decoding_method,
            "pardec.steps": self.steps, "pardec.draft_tokens": self.draft_tokens,
            "pardec.accepted_draft_tokens": self.accepted_draft_tokens,
            "pardec.mean_accepted_length": self.mean_accepted_length,
            "pardec.cached_prompt_tokens": self.cached_prompt_tokens, "pardec.verifier_ms": self.verifier_ms,
            "pardec.drafter_ms": self.drafter_ms,
        }


@dataclass(frozen=True)
class Chunk:
    """One streamed message: a step's new text and tokens; the last has finish_reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: str = ""
    stats: Stats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, if asked for
    # The first chunk only, with prompt_logprobs: the prompt's tokens, each one's log-probability but the first's.
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0  # the first chunk only: the prompt's length (the stats come with the last)
    cached_tokens: int = 0  # the first chunk only: how many of them the verifier's prefix cache held


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" | "eos"
    stats: Stats
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, if asked for
    prompt_token_ids: list[int] = field(default_factory=list)  # as Chunk's
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


def joined(chunks: list[Chunk]) -> Generation:
    """A stream's chunks as one answer: the unary answer is the stream joined, by construction."""
    return Generation("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason,
                      chunks[-1].stats, [lp for c in chunks for lp in c.logprobs], chunks[0].prompt_token_ids,
                      chunks[0].prompt_logprobs)
