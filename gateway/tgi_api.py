"""Text Generation Inference's API (``POST /generate``, ``/generate_stream``, ``GET /info``; MindIE
Service serves the same), protobuf-free: a body (``inputs``, raw text with no chat template, and
``parameters``) becomes the completions request it means (openai_api.completion_request: one set
of rules), and a generation becomes TGI's reply, its stream's events, or its error.

    >>> body = completion_body({"inputs": "def f(", "parameters": {"max_new_tokens": 8, "stop": [")"]}}, plain=False)
    >>> body["prompt"], body["max_tokens"], body["stop"], body["temperature"]
    ('def f(', 8, [')'], 0.0)

Sampling is TGI's: greedy unless ``do_sample`` or a sampling parameter (``temperature``,
``top_k``, ``top_p``) is set. ``details`` carries each token with its log-probability where
plain decoding makes it (``parameters.parallel_decoding: false``, or a server without parallel
decoding: MindIE's rule), else ``logprob`` null; ``decoder_input_details`` scores the prompt (plain
decoding only).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pardec.gateway.outputs import Chunk, Generation
from pardec.gateway.http_errors import ErrorShape
from pardec.runtime.errors import InvalidArgument, PardecError
from pardec.verifier.api import TokenLogprob

FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length"}
# TGI's parameters that are the completions body's under another name (or the same).
_SAME = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
         "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
         "stop": "stop", "parallel_decoding": "parallel_decoding", "session_id": "session_id", "draft": "draft",
         "cache_salt": "cache_salt", "min_p": "min_p", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
         "stop_token_ids": "stop_token_ids", "truncate": "truncate_prompt_tokens"}
_OFF = {"typical_p": "typical sampling is not supported", "watermark": "watermarking is not supported",
        "adapter_id": "adapters (LoRA) are not served"}
_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # a sampling parameter's value that changes nothing


def completion_body(body: Any, plain: bool) -> dict[str, Any]:
    """The /v1/completions body a TGI body means; ``plain``: whether the server decodes it plainly."""
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object with inputs and parameters")
    inputs, parameters = body.get("inputs"), body.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(inputs, str) or not inputs:
        raise InvalidArgument("inputs: required, a non-empty string")
    if not isinstance(parameters, dict):
        raise InvalidArgument("parameters: must be an object")
    for name, rule in _OFF.items():
        if parameters.get(name) not in (None, False):
            raise InvalidArgument(f"parameters.{name}: {rule}")
    if parameters.get("best_of") not in (None, 1):
        raise InvalidArgument("parameters.best_of: must be 1 (multi-sequence inference is not supported)")
    truncate = parameters.get("truncate")  # TGI's is a count of tokens (vLLM's -1 is not TGI's)
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 1):
        raise InvalidArgument(f"parameters.truncate: must be an integer >= 1, got {truncate!r:.40}")
    temperature = parameters.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature <= 0:
        raise InvalidArgument("parameters.temperature: must be strictly positive (greedy is do_sample false)")
    completion = {_SAME[name]: value for name, value in parameters.items() if name in _SAME}
    completion["prompt"] = inputs
    completion["include_stop_str_in_output"] = True  # TGI's text keeps the stop sequence it ended on
    # TGI's rule: sampling with do_sample, or where a parameter changes the distribution.
    sampled = parameters.get("do_sample") is True or any(parameters.get(name) not in (None, off)
                                                         for name, off in _NEUTRAL.items())
    completion["temperature"] = (1.0 if temperature is None else temperature) if sampled else 0.0
    if sampled and completion.get("seed") is None:  # TGI says which seed it drew with
        completion["seed"] = secrets.randbelow(2**63)
    plain = plain or parameters.get("parallel_decoding") is False
    if plain:  # each token's log-probability, as TGI gives it, comes with plain decoding
        completion["logprobs"] = _count(parameters, "top_n_tokens")
    elif parameters.get("top_n_tokens"):
        raise InvalidArgument("parameters.top_n_tokens: with plain decoding only (parallel decoding returns no "
                              "log-probabilities)")
    if parameters.get("decoder_input_details"):
        completion["prompt_logprobs"] = 0
    grammar = parameters.get("grammar")
    if grammar is not None:
        completion["structured_outputs"] = _grammar(grammar)
    return completion


def _count(parameters: dict, name: str) -> int:
    value = parameters.get(name) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"parameters.{name}: must be an integer >= 0")
    return value


def _grammar(grammar: Any) -> dict[str, Any]:
    """TGI's grammar: {"type": "json" (or "json_schema"), "value": a schema} or {"type": "regex", "value": ...}."""
    kind = grammar.get("type") if isinstance(grammar, dict) else None
    if kind in ("json", "json_schema"):
        value = grammar.get("value")
        return {"json": value.get("schema", value) if isinstance(value, dict) and kind == "json_schema" else value}
    if kind == "regex":
        return {"regex": grammar.get("value")}
    raise InvalidArgument('parameters.grammar: must be {"type": "json", "value": {...}} or {"type": "regex", '
                          '"value": "..."}')


_NAMES = [(re.compile(r"^prompt\b"), "inputs"), (re.compile(r"^max_tokens\b|^max_new_tokens\b"), "parameters.max_new_tokens"),
          (re.compile(r"^(?:logprobs|top_logprobs)\b"), "parameters.details"),
          (re.compile(r"^prompt_logprobs\b"), "parameters.decoder_input_details"),
          (re.compile(r"^structured_outputs(?:\.\w+)?|^sampling\.structured_output(?:\.\w+)?"), "parameters.grammar"),
          (re.compile(r"^(?:sampling\.)?(temperature|top_k|top_p|min_p|seed|repetition_penalty|frequency_penalty|"
                      r"stop|stop_token_ids|min_tokens|parallel_decoding|session_id|draft|cache_salt|ignore_eos)\b"),
           r"parameters.\1"), (re.compile(r"^truncate_prompt_tokens\b"), "parameters.truncate")]


def renamed(error: PardecError) -> PardecError:
    """A completions error, its field named as a TGI body names it.

    >>> str(renamed(InvalidArgument("max_tokens: must be >= 1, got 0")))
    'parameters.max_new_tokens: must be >= 1, got 0'
    """
    message = str(error)
    for pattern, name in _NAMES:
        message, found = pattern.subn(name, message, count=1)
        if found:
            break
    return error.reworded(message)


class TgiErrors(ErrorShape):
    """TGI's error JSON, {"error", "error_type"}: a request it refuses is 422 ("validation"), a
    busy server 429 ("overloaded"), a generation that fails 424 ("generation")."""

    def body(self, error: PardecError) -> tuple[int, dict[str, Any]]:
        status, _ = super().body(error)
        kind = {429: "overloaded", 401: "unauthorized"}.get(status, "generation" if status >= 500 else "validation")
        status = 422 if status == 400 else 424 if status >= 500 else status
        return status, {"error": str(error), "error_type": kind}

    def event(self, error: PardecError) -> tuple[dict[str, Any], str | None]:
        return self.body(error)[1], None


def _token(tokenizer, token: int, text: str, logprob: TokenLogprob | None) -> dict[str, Any]:
    return {"id": token, "text": text, "logprob": None if logprob is None else logprob.logprob,
            "special": token in tokenizer.control_ids}


def _top(tokenizer, logprob: TokenLogprob | None) -> list[dict[str, Any]]:
    return [] if logprob is None else [_token(tokenizer, t, tokenizer.decode([t]), TokenLogprob(lp)) for t, lp in
                                       logprob.top]


def reply(generation: Generation, tokenizer, parameters: dict[str, Any], inputs: str) -> dict[str, Any]:
    """/generate's answer: the text (after the inputs with return_full_text), and with details each token."""
    text = (inputs if parameters.get("return_full_text") else "") + generation.text
    if not parameters.get("details") and not parameters.get("decoder_input_details"):
        return {"generated_text": text}
    logprobs = generation.logprobs or [None] * len(generation.token_ids)
    details = {"finish_reason": FINISH[generation.finish_reason], "generated_tokens": len(generation.token_ids),
               "seed": parameters.get("seed"), "best_of_sequences": None,
               "prefill": [_token(tokenizer, token, tokenizer.decode([token]), None if index == 0 else TokenLogprob(
                   generation.prompt_logprobs[index - 1].logprob)) for index, token in
                   enumerate(generation.prompt_token_ids)],
               "tokens": [_token(tokenizer, token, tokenizer.decode([token]), logprob)
                          for token, logprob in zip(generation.token_ids, logprobs)]}
    if parameters.get("top_n_tokens"):
        details["top_tokens"] = [_top(tokenizer, logprob) for logprob in logprobs]
    return {"generated_text": text, "details": details}


class TgiEvents:
    """/generate_stream's events: one per token, its text the part of the stream's text it
    brought (the texts add up to the answer's). A step's last token is held until the next step
    (text held back for stop strings comes later): the last event has the whole text and details."""

    def __init__(self, tokenizer, parameters: dict[str, Any], inputs: str):
        self.tokenizer, self.parameters, self.inputs = tokenizer, parameters, inputs
        self._index, self._text = 0, ""
        self._held: dict[str, Any] | None = None

    def chunks(self, chunk: Chunk) -> list[dict[str, Any]]:
        events, rest = [], chunk.text
        logprobs = chunk.logprobs or [None] * len(chunk.token_ids)
        for token, logprob in zip(chunk.token_ids, logprobs):
            piece = self.tokenizer.decode([token])
            text = piece if piece and rest.startswith(piece) else ""
            rest = rest[len(text):]
            if self._held is not None:
                events.append(self._held)
            self._index += 1
            self._held = {"index": self._index, "token": _token(self.tokenizer, token, text, logprob),
                          "top_tokens": _top(self.tokenizer, logprob) if self.parameters.get("top_n_tokens") else None,
                          "generated_text": None, "details": None}
        if self._held is not None:  # the step's text not yet given to a token: its last one's
            self._held["token"]["text"] += rest
        self._text += chunk.text
        if chunk.finish_reason and self._held is not None:
            self._held["generated_text"] = (self.inputs if self.parameters.get("return_full_text") else "") + self._text
            self._held["details"] = {"finish_reason": FINISH[chunk.finish_reason], "generated_tokens": self._index,
                                     "seed": self.parameters.get("seed"),
                                     "input_length": chunk.stats.prompt_tokens if chunk.stats else 0}
            events.append(self._held)
            self._held = None
        return events
