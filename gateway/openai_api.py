"""OpenAI's request bodies and errors, protobuf-free: a parsed JSON body becomes the same
`Request` the gRPC servicer builds (the replies' JSON: gateway/openai_replies.py).

The HTTP front (gateway/http_front.py) only moves bytes; every rule lives here or in the core,
so both fronts refuse the same requests with the same words, named as each front's client
spells the field. A worked example:

    >>> body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
    ...         "temperature": 0}
    >>> request = chat_request(body, tenant="", model_name="m")
    >>> request.messages[0].content, request.max_new_tokens, request.sampling.greedy, request.plain
    ('Hi', 8, True, False)

Defaults follow OpenAI's API, not pardec's gRPC defaults: an absent ``temperature`` is 1.0
(sampling), as OpenAI documents it and as vLLM serves it. Extensions a client may send beside
OpenAI's fields: ``parallel_decoding`` (false: plain decoding), ``session_id`` (the drafting
memory of a conversation) and ``draft`` (per-request limits on the server's plugin_params, the
gRPC `draft` message's fields); ``top_k`` and ``repetition_penalty`` as vLLM accepts them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any

from pardec.gateway.choices import prompt_named
from pardec.gateway.chat import template_variables
from pardec.gateway.generation import Request
from pardec.gateway.openai_structured import FIELDS as STRUCTURED_FIELDS
from pardec.gateway.rules import MAX_SEQUENCES, bounded_sequences
from pardec.gateway.openai_structured import structured_output
from pardec.gateway.openai_responses import FIELDS as RESPONSE_FIELDS
from pardec.gateway.openai_tools import FIELDS as TOOL_FIELDS
from pardec.gateway.openai_messages import chat_message, predicted_text, show
from pardec.gateway.openai_tools import tool_use, valid_text
from pardec.runtime.draft_params import OVERRIDABLE, DraftOverrides
from pardec.runtime.errors import InvalidArgument, NotFound
from pardec.runtime.security import cache_scope, memory_scope
from pardec.verifier.api import MAX_THINKING_BUDGET, Sampling, ThinkingBudget

log = logging.getLogger(__name__)

# Fields that ask for something pardec does not do: refused, naming the field, when set to
# anything but their "off" value (a client that sends the default loses nothing).
_REFUSED = {
    "functions": "the legacy function calling is not supported; send tools and tool_choice",
    "function_call": "the legacy function calling is not supported; send tools and tool_choice",
    "audio": "audio output is not supported",
    "echo": "only /v1/completions echoes the prompt",
    "suffix": "a suffix (insertion) is not supported",
}
_OFF = (None, False, "", [], {}, "none", "auto")
# Accepted and without effect on the output: no log line for them.
_HARMLESS = {"user", "store", "metadata", "service_tier", "stream", "stream_options", "model", "reasoning_effort",
             "modalities", "web_search_options", "verbosity", "safety_identifier", "prompt_cache_key"}
_COMMON = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "best_of", "logprobs",
           "top_logprobs", "prompt_logprobs", "parallel_decoding", "session_id", "draft", "cache_salt",
           "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "min_tokens", "logit_bias",
           "allowed_token_ids", "thinking_token_budget", "bad_words", "return_token_ids", "truncate_prompt_tokens",
           "priority", "prediction", "use_beam_search", "length_penalty", *STRUCTURED_FIELDS}
CHAT_FIELDS = frozenset({"messages", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
                         *_COMMON, *_HARMLESS, *_REFUSED, *TOOL_FIELDS})
COMPLETION_FIELDS = frozenset({"prompt", *_COMMON, *_HARMLESS, *_REFUSED})
_PARAMS = CHAT_FIELDS | COMPLETION_FIELDS | RESPONSE_FIELDS | {"body", "X-Request-Timeout", "tokens"}
MAX_SEED = 2**64 - 1  # the gRPC field is a uint64
# A completions batch's prompts times n: the sessions one request (one admission slot) may start.
MAX_BATCH_SEQUENCES = MAX_SEQUENCES
MAX_TOP_K = 2**31 - 1  # an int32 on the wire
MAX_FLOAT = 3.0e38  # the wire's floats are float32: a larger value would become infinity

# The core names fields as the gRPC contract does; an HTTP client reads OpenAI's names.
_HTTP_NAMES = {"max_new_tokens": "max_tokens", "decoding": "parallel_decoding", "token_ids": "tokens",
               "thinking_budget": "thinking_token_budget", "prompt_token_ids": "prompt"}
_FIELD = re.compile(r"^(sampling\.)?([A-Za-z_][\w.]*(?:\[\d+\][\w.]*)*)")


def http_field(message: str) -> tuple[str, str]:
    """(param, message) of a core error, the leading field renamed as an HTTP client spells it.

    >>> http_field("sampling.temperature: must be a finite number >= 0, got -1.0")
    ('temperature', 'temperature: must be a finite number >= 0, got -1.0')
    >>> http_field("max_new_tokens = 9000: must not exceed ScheduleConfig.maxIterTimes (512)")[0]
    'max_tokens'
    >>> http_field("token_ids[0]: 49152 is not a token of the model")[0], http_field("prompt_token_ids[3]: ...")[0]
    ('tokens[0]', 'prompt[3]')
    """
    match = _FIELD.match(message)
    if not match or not message.startswith((":", " = "), match.end()):
        return "", message
    name = match.group(2)
    base = re.split(r"[.\[]", name, maxsplit=1)[0]
    renamed = _HTTP_NAMES.get(base, base) + name[len(base):]
    if _HTTP_NAMES.get(base, base) not in _PARAMS:  # a method's or a service's name
        return "", message
    return renamed, renamed + message[match.end():]


# The fields a body may name its most tokens in (the Responses API's is max_output_tokens).
_LENGTH_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def with_defaults(body: dict[str, Any], defaults: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    """``body`` with the model's sampling defaults (its generation_config.json, as vLLM's
    --generation-config auto serves them) for the fields it leaves out or sends as null; the
    model's max_new_tokens caps any larger number of tokens the body names, as in vLLM (a
    score-only 0 and a malformed value are left to the request's own checks; a body naming none
    gets the server's default, which the Generator caps alike).

    >>> with_defaults({"temperature": None, "top_p": 0.5}, (("temperature", 0.6), ("top_p", 0.95)))
    {'temperature': 0.6, 'top_p': 0.5}
    >>> limit = (("max_new_tokens", 64),)
    >>> with_defaults({}, limit), with_defaults({"max_tokens": 500, "max_completion_tokens": 8}, limit)
    ({}, {'max_tokens': 64, 'max_completion_tokens': 8})
    """
    fields = dict(defaults)
    limit = fields.pop("max_new_tokens", None)
    if body.get("use_beam_search") is True:  # raw log-probabilities rank beams: no sampling to default
        fields = {}
    out = {**body, **{name: value for name, value in fields.items() if body.get(name) is None}}
    if limit is None:
        return out
    for name in (name for name in _LENGTH_FIELDS if out.get(name) is not None):
        value = out[name]
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            out[name] = int(limit)
    return out


def chat_request(body: dict[str, Any], tenant: str, model_name: str) -> Request:
    """A /v1/chat/completions body as the core's Request; InvalidArgument or NotFound naming the field."""
    _check_common(body, CHAT_FIELDS, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: required, a non-empty array of {role, content} objects")
    return _request(body, tenant, model_name, messages=tuple(chat_message(i, m) for i, m in enumerate(messages)),
                    tools=tool_use(body), chat_template_kwargs=template_variables(body.get("chat_template_kwargs")),
                    continue_final_message=continued(body))


def continued(body: dict[str, Any]) -> bool:
    """vLLM's continue_final_message, with add_generation_prompt (vLLM's rule: not both true; a
    turn is opened for the answer unless the last message is continued).

    >>> continued({}), continued({"continue_final_message": True, "add_generation_prompt": False})
    (False, True)
    """
    go_on, opened = _flag(body, "continue_final_message", False), _flag(body, "add_generation_prompt", None)
    if go_on and opened:
        raise InvalidArgument("add_generation_prompt: cannot be true with continue_final_message (vLLM's rule)")
    if opened is False and not go_on:
        raise InvalidArgument("add_generation_prompt: false only with continue_final_message: true (else the "
                              "answer is a turn of its own)")
    return go_on


def completion_request(body: dict[str, Any], tenant: str, model_name: str) -> Request:
    """A /v1/completions body: the prompt sent as text, without the chat template (raw). With
    ``echo`` and ``logprobs``, the prompt's tokens are scored too (`echoed` says whether to show it)."""
    echo = echoed(body)
    if scores_only(body):
        body = {**body, "max_tokens": 1}  # the first token is made anyway (the prompt's last row); not sent
    _check_common({name: value for name, value in body.items() if name != "echo"}, COMPLETION_FIELDS, model_name)
    for name in sorted(TOOL_FIELDS & body.keys()):
        if body[name] not in _OFF:
            raise InvalidArgument(f"{name}: tools are called on /v1/chat/completions, not on /v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request = _request(body, tenant, model_name, prompt_token_ids=tuple(_token_ids(body, "prompt", prompt)))
    elif isinstance(prompt, str):
        request = _request(body, tenant, model_name, prompt=valid_text(prompt, "prompt"), raw=True)
    else:
        raise InvalidArgument("prompt: must be a string or an array of token ids (one prompt per request)")
    if echo and request.logprobs:  # the echoed prompt's tokens are scored as the answer's
        request = dataclasses.replace(request, prompt_logprobs=max(request.top_logprobs, request.prompt_logprobs or 0))
    return request


def completion_requests(body: dict[str, Any], tenant: str, model_name: str) -> list[Request]:
    """A /v1/completions body's requests: one per prompt of a batch (an array of several strings or
    token-id arrays, as vLLM takes and lm-evaluation-harness sends), else `completion_request`'s
    one. Each is checked alone; its error names its prompt (``prompt[2]``)."""
    prompts = body.get("prompt") if isinstance(body, dict) else None
    if not (isinstance(prompts, list) and len(prompts) > 1 and all(isinstance(p, (str, list)) for p in prompts)):
        return [completion_request(body, tenant, model_name)]
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if len(prompts) * max(1, n) > MAX_BATCH_SEQUENCES:
        raise InvalidArgument(f"prompt: {len(prompts)} prompts of {max(1, n)} sequences each; at most "
                              f"{MAX_BATCH_SEQUENCES} sequences a request")
    requests = []
    for index, prompt in enumerate(prompts):
        try:
            requests.append(completion_request({**body, "prompt": [prompt]}, tenant, model_name))
        except InvalidArgument as error:
            raise prompt_named(error, index) from None
    return requests


def echoed(body: dict[str, Any]) -> bool:
    """Whether a completions body asks for its prompt back in front of the text (OpenAI's echo)."""
    return _flag(body, "echo", False)


def returns_token_ids(body: dict[str, Any]) -> bool:
    """Whether a body asks for the prompt's and the answer's token ids beside the text (vLLM's return_token_ids)."""
    return _flag(body, "return_token_ids", False)


def scores_only(body: dict[str, Any]) -> bool:
    """Whether a completions body asks for its prompt scored and nothing generated: echo with
    max_tokens 0, as OpenAI's legacy API took it."""
    tokens = body.get("max_tokens")
    return echoed(body) and tokens == 0 and not isinstance(tokens, bool) and "max_completion_tokens" not in body


def _check_common(body: dict[str, Any], known: frozenset[str], model_name: str) -> None:
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise InvalidArgument("model: must be a string")
        if model != model_name:
            raise NotFound(f"model: {model[:200]!r} is not served here; this server serves {model_name!r} (GET /v1/models)")
    for name, rule in _REFUSED.items():
        if body.get(name) not in _OFF:
            raise InvalidArgument(f"{name}: {rule}")
    if body.get("stream_options") is not None:
        if not body.get("stream"):
            raise InvalidArgument("stream_options: only with stream: true")
        if not isinstance(body["stream_options"], dict):
            raise InvalidArgument("stream_options: must be an object")
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        shown = ", ".join(ascii(name[:40]) for name in unknown[:8])  # ascii(): no forged log lines
        log.info("ignored unknown request fields: %s%s", shown, " ..." if len(unknown) > 8 else "")


def _request(body: dict[str, Any], tenant: str, model_name: str, **input_fields) -> Request:
    max_tokens = _number(body, "max_completion_tokens", int, low=1)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, low=1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidArgument("stop: must be a string or an array of strings")
    stop = [valid_text(text, f"stop[{index}]") for index, text in enumerate(stop or ())]
    parallel = _flag(body, "parallel_decoding", True)
    stop_token_ids = _token_ids(body, "stop_token_ids")
    logprobs, top_logprobs = requested(body)
    session_id = body.get("session_id", "")
    if not isinstance(session_id, str):
        raise InvalidArgument("session_id: must be a string")
    seed = _number(body, "seed", int, low=0, high=MAX_SEED)
    prompt_logprobs = _number(body, "prompt_logprobs", int)  # vLLM's; the rules bound it
    if prompt_logprobs is not None and body.get("stream"):
        raise InvalidArgument("prompt_logprobs: not with stream (the prompt's scores come with the whole answer)")
    try:
        sampling = Sampling(
            temperature=_number(body, "temperature", float, low=0.0, high=MAX_FLOAT, default=1.0),
            top_k=max(0, _number(body, "top_k", int, low=-1, high=MAX_TOP_K, default=0)),  # vLLM's -1, 0: off
            top_p=_number(body, "top_p", float, low=0.0, high=1.0, default=1.0),
            min_p=_number(body, "min_p", float, low=0.0, high=1.0, default=0.0),
            repetition_penalty=_number(body, "repetition_penalty", float, high=MAX_FLOAT, default=1.0),
            presence_penalty=_number(body, "presence_penalty", float, default=0.0),
            frequency_penalty=_number(body, "frequency_penalty", float, default=0.0),
            seed=seed,
            min_tokens=_number(body, "min_tokens", int, low=0, default=0),
            logit_bias=_logit_bias(body.get("logit_bias")),
            allowed_token_ids=tuple(_token_ids(body, "allowed_token_ids")),
        )
    except InvalidArgument as error:
        raise InvalidArgument(http_field(str(error))[1]) from None
    budget = _number(body, "thinking_token_budget", int, low=0, high=MAX_THINKING_BUDGET)  # vLLM's
    bad_words = body.get("bad_words")  # vLLM's
    bad_words = [] if bad_words is None else bad_words
    if not (isinstance(bad_words, list) and all(isinstance(word, str) for word in bad_words)):
        raise InvalidArgument("bad_words: must be an array of strings")
    sampling = dataclasses.replace(sampling, structured_output=structured_output(body),
                                   thinking_budget=None if budget is None else ThinkingBudget(budget))
    return Request(
        max_new_tokens=max_tokens or 0,
        plain=not parallel,
        sampling=sampling,
        n=bounded_sequences(_number(body, "n", int, low=0, default=0)),  # before a stream's writers exist
        best_of=_number(body, "best_of", int, low=0, default=0),
        use_beam_search=_flag(body, "use_beam_search", False),  # vLLM's: n beams, best first
        length_penalty=_number(body, "length_penalty", float, low=-MAX_FLOAT, high=MAX_FLOAT, default=1.0),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=tuple(stop),
        session_id=memory_scope(tenant, model_name, session_id),
        tenant=tenant,
        cache_scope=cache_scope(tenant, body.get("cache_salt", "")),
        draft=_draft(body.get("draft")),
        ignore_eos=_flag(body, "ignore_eos", False),
        stop_token_ids=tuple(stop_token_ids),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        keep_special_tokens=not _flag(body, "skip_special_tokens", True),  # vLLM's
        bad_words=tuple(bad_words),
        truncate_prompt_tokens=_number(body, "truncate_prompt_tokens", int),  # vLLM's; the generator bounds it
        priority=_number(body, "priority", int, low=-2**31, high=2**31 - 1, default=0),  # vLLM's: an int32 on the wire
        prediction=predicted_text(body.get("prediction")),
        **input_fields,
    )


def requested(body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs, top_logprobs) of a request body: chat sends `logprobs` true and `top_logprobs`
    N, completions `logprobs` N (0: the chosen token's alone)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs", 0)
    if top is None:
        top = 0
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise InvalidArgument(f"top_logprobs: must be an integer >= 0, got {top!r}")
    if logprobs is None or isinstance(logprobs, bool):
        return bool(logprobs), top
    if isinstance(logprobs, int) and logprobs >= 0:
        return True, max(top, logprobs)
    raise InvalidArgument("logprobs: must be a boolean (chat) or an integer >= 0 (completions)")


def detokenize_request(body: dict[str, Any], model_name: str) -> list[int]:
    """A /detokenize body's token ids; InvalidArgument or NotFound naming the field."""
    _check_common(body, frozenset({"tokens", "model"}), model_name)
    return _token_ids(body, "tokens")


def _token_ids(body: dict, name: str, value: Any = None) -> list[int]:
    """``body[name]`` (or ``value``, read from there) checked as token ids."""
    value = (body.get(name) if value is None else value) or []
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                            for t in value)):
        raise InvalidArgument(f"{name}: must be an array of token ids (integers >= 0)")
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias, ...}, as (token, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument("logit_bias: must be an object mapping token ids to biases")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise InvalidArgument(f"logit_bias: {show(key)} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidArgument(f"logit_bias[{key}]: must be a number, got {show(bias)}")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def streamed(body: dict[str, Any]) -> bool:
    """The body's ``stream`` switch."""
    return bool(_flag(body, "stream", False))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}: must be true or false, got {show(value)}")
    return value


def _number(body: dict, name: str, kind: type, low=None, high=None, default=None):
    value = body.get(name)
    if value is None:
        return default
    # JSON's true is not a number, and a float field takes integers (OpenAI's clients send 1 for 1.0).
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise InvalidArgument(f"{name}: must be {'a number' if kind is float else 'an integer'}, got {show(value)}")
    if kind is float and not math.isfinite(value):
        raise InvalidArgument(f"{name}: must be a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidArgument(f"{name}: must be {bounds}, got {value}")
    return kind(value)


def _draft(value: Any) -> DraftOverrides:
    if value is None:
        return DraftOverrides()
    names = {param.name for param in OVERRIDABLE}
    if not isinstance(value, dict) or not set(value) <= names:
        raise InvalidArgument(f"draft: must be an object with some of {sorted(names)}")
    for name, limit in value.items():
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidArgument(f"draft.{name}: must be an integer, got {show(limit)}")
    return DraftOverrides(**value)
