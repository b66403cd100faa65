"""The verifier's calls in Python types, shared by the engine that serves them and the gateway's
clients that make them: how a session samples and what one verify step answers.

Torch-free (only the generated messages and the error type), so the gateway imports it without
the engine. Sampling is validated here, on construction, once for both sides: a bad value is
refused where it enters, with the name of its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2
from pardec.verifier.structured_output import StructuredOutput


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model's raw distribution (before
    temperature, penalties, top-k / top-p), and the ``top`` most likely tokens' as
    (token, log-probability) pairs, most likely first (pardec.v1.TokenLogprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_proto(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(logprob=self.logprob, top_token_ids=[t for t, _ in self.top],
                                       top_logprobs=[lp for _, lp in self.top])

    @classmethod
    def from_proto(cls, message: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(message.logprob, tuple(zip(message.top_token_ids, message.top_logprobs)))


class Prefilled(NamedTuple):
    """What a prefill answers: the first generated token (the root of the first tree), the
    time its forwards took, how many prompt tokens came from the prefix cache instead, and the
    token's log-probability where the session asked for them."""

    token: int
    compute_ms: float = 0.0
    cached_tokens: int = 0
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # where asked for: each prompt token's but the first


# The smallest temperature that samples; 0 is greedy.
MIN_TEMPERATURE = 1e-6
# The most top log-probabilities a token may carry (OpenAI's and vLLM's default cap).
MAX_LOGPROBS = 20
# OpenAI's range of a logit bias, and the most entries one request may bias.
MAX_BIAS = 100.0
# OpenAI's range of the presence and frequency penalties.
MAX_PENALTY = 2.0
# The longest name a served model may have (MindIE's modelName, vLLM's --served-model-name).
MAX_MODEL_NAME = 256


def valid_model_name(name: str) -> bool:
    """Whether ``name`` may name the served model: 1 to MAX_MODEL_NAME printable characters, no
    spaces around them (a name clients send back as the OpenAI API's ``model``).

    >>> valid_model_name("llama3-8b"), valid_model_name(" x"), valid_model_name("a\nb"), valid_model_name("")
    (True, False, False, False)
    """
    return isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME and name.isprintable() and name == name.strip()
MAX_LOGIT_BIAS = 1024
MAX_THINKING_BUDGET = 2**31 - 1
MAX_BAD_WORDS = 128  # token sequences; each of 1 to MAX_BAD_WORD_TOKENS ids
MAX_BAD_WORD_TOKENS = 32


@dataclass(frozen=True)
class ThinkingBudget:
    """A reasoning model's thinking bounded (pardec.v1.ThinkingBudget): after ``tokens`` tokens of
    thinking its closing tag is forced (engine/thinking_budget.py). ``opened``: the prompt opened
    the block, so the output starts inside it; else the output may open one, and is bounded then."""

    tokens: int
    opened: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tokens <= MAX_THINKING_BUDGET:
            raise InvalidArgument(f"sampling.thinking_budget.tokens: must be in [0, {MAX_THINKING_BUDGET}], "
                                  f"got {self.tokens}")


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen from a row of logits (greedy when temperature == 0).

    ``seed`` travels with the request's other parameters; the engine takes it as prefill's own
    argument, because only the prefill uses it (to seed the session's generator). ``logprobs``
    (None: none) asks for each generated token's log-probability and that many of the most
    likely tokens' beside it, ``prompt_logprobs`` the same for the prompt's tokens; neither
    changes any token (PrefillRequest.logprobs and .prompt_logprobs on the wire)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens at least this share of the likeliest's probability; 0: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # taken off the logit of each token the output holds
    frequency_penalty: float = 0.0  # taken off a token's logit once per time the output holds it
    seed: int | None = None  # None: a fresh random seed
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # empty: any
    stop_token_ids: tuple[int, ...] = ()  # what min_tokens holds back (PrefillRequest.stop_token_ids)
    structured_output: StructuredOutput | None = None  # None: free text
    thinking_budget: ThinkingBudget | None = None  # None: the thinking is unbounded
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never holds (engine/bad_words.py)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidArgument(f"sampling.temperature: must be a finite number >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # logits / temperature overflows to inf for denormal temperatures, and softmax then
            # gives NaN; below this a draw is greedy in all but exact ties anyway.
            raise InvalidArgument(f"sampling.temperature: must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                  f"got {self.temperature:g}")
        if self.top_k < 0:
            raise InvalidArgument(f"sampling.top_k: must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"sampling.top_p: must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"sampling.min_p: must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidArgument(
                f"sampling.repetition_penalty: must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # NaN included
                raise InvalidArgument(f"sampling.{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                      f"got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise InvalidArgument(f"sampling.min_tokens: must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not -MAX_BIAS <= bias <= MAX_BIAS:  # NaN included
                raise InvalidArgument(f"sampling.logit_bias[{token}]: must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidArgument(f"sampling.bad_words: at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words)}")
        for index, words in enumerate(self.bad_words):
            if not 0 < len(words) <= MAX_BAD_WORD_TOKENS:
                raise InvalidArgument(f"sampling.bad_words[{index}]: must hold 1 to {MAX_BAD_WORD_TOKENS} token ids, "
                                      f"got {len(words)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidArgument(f"{name}: must be in [0, {MAX_LOGPROBS}] top tokens, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a row's logits depend on the tokens before it (acceptance.penalize)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def constrains(self) -> bool:
        """Whether logits are changed before a choice (acceptance.constrain)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids)

    @classmethod
    def from_proto(cls, params: common_pb2.SamplingParams) -> Sampling:
        """The message's sampling; its unset fields (top_p 0, no repetition_penalty) disable
        their filter."""
        return cls(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p if params.top_p else 1.0,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=params.seed if params.HasField("seed") else None,
            min_tokens=params.min_tokens,
            logit_bias=tuple(sorted(params.logit_bias.items())),
            allowed_token_ids=tuple(params.allowed_token_ids),
            structured_output=(StructuredOutput.from_proto(params.structured_output)
                               if params.HasField("structured_output") else None),
            thinking_budget=(ThinkingBudget(params.thinking_budget.tokens,
                                            params.thinking_budget.reasoning == common_pb2.REASONING_OPEN)
                             if params.HasField("thinking_budget") else None),
            bad_words=tuple(tuple(words.token_ids) for words in params.bad_words),
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                           min_p=self.min_p,
                                           presence_penalty=self.presence_penalty,
                                           frequency_penalty=self.frequency_penalty,
                                           min_tokens=self.min_tokens, logit_bias=dict(self.logit_bias),
                                           allowed_token_ids=self.allowed_token_ids,
                                           bad_words=[common_pb2.TokenSequence(token_ids=words)
                                                      for words in self.bad_words])
        if self.seed is not None:
            params.seed = self.seed
        if self.structured_output is not None:
            params.structured_output.CopyFrom(self.structured_output.to_proto())
        if self.repetition_penalty != 1.0:  # 1.0 is the absent field's meaning
            params.repetition_penalty = self.repetition_penalty
        if self.thinking_budget is not None:
            params.thinking_budget.CopyFrom(common_pb2.ThinkingBudget(
                tokens=self.thinking_budget.tokens,
                reasoning=common_pb2.REASONING_OPEN if self.thinking_budget.opened else common_pb2.REASONING_BLOCK))
        return params


@dataclass(frozen=True)
class Verification:
    """One verify step's answer (pardec.v1.VerifyResponse)."""

    accepted_tokens: list[int]
    bonus_token: int  # the model's own token after the accepted path: the next root
    node_argmax: list[int]  # after the root, then after each node
    compute_ms: float
    # Tree indices of the accepted nodes; empty where the step verified no tree of the caller's
    # (a session resumed on another replica, a modelled step).
    accepted_nodes: list[int] = field(default_factory=list)
    # Where the session asked for them: one per committed token, the accepted ones then the bonus.
    logprobs: list[TokenLogprob] = field(default_factory=list)
