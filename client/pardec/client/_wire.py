"""What the sync and the asyncio client share: requests built from keyword arguments, replies
read from responses, call options and errors. The gateway checks every value; the client only
translates, so that the server's rules live in one place."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import grpc

from pardec.client._types import (
    Chunk,
    Message,
    MessageLike,
    ParallelDecoding,
    PardecError,
    Reply,
    ServedModel,
    Stats,
    TokenLogprob,
    ToolCall,
)
from pardec.v1 import common_pb2, gateway_pb2

ROLES = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT,
         "tool": gateway_pb2.ROLE_TOOL}


def build_request(
    prompt: str | None,
    messages: Iterable[MessageLike] | None,
    *,
    system: str | None = None,
    raw: bool = False,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Sequence[int] = (),
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    include_stop_str_in_output: bool = False,
    keep_special_tokens: bool = False,
    ignore_eos: bool = False,
    session_id: str = "",
    cache_salt: str = "",
    plain: bool = False,
    n: int = 0,
    use_beam_search: bool = False,
    length_penalty: float | None = None,
    draft: Mapping[str, int] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    prompt_token_ids: Sequence[int] = (),
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
    thinking_budget: int | None = None,
    bad_words: str | Sequence[str] = (),
    truncate_prompt_tokens: int | None = None,
    priority: int = 0,
    prediction: str = "",
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest; a system message turns a prompt into a conversation of two messages."""
    turns = None if messages is None else [_message(m) for m in messages]
    if system is not None:
        if turns is None:
            turns, prompt = [gateway_pb2.Message(role=ROLES["user"], content=prompt or "")], None
        turns.insert(0, gateway_pb2.Message(role=ROLES["system"], content=system))
    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                         min_tokens=min_tokens,
                                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                         logit_bias=dict(logit_bias or {}), allowed_token_ids=list(allowed_token_ids))
    if seed is not None:
        sampling.seed = seed
    language = _structured_output(json_schema, regex, choice, grammar, json_object)
    if language is not None:
        sampling.structured_output.CopyFrom(language)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if thinking_budget is not None:  # the server reads where the thinking starts from the template
        sampling.thinking_budget.CopyFrom(common_pb2.ThinkingBudget(tokens=thinking_budget))
    request = gateway_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=turns or (),
        raw=raw,
        max_new_tokens=max_new_tokens,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT,
        sampling=sampling,
        n=n,
        use_beam_search=use_beam_search,
        length_penalty=length_penalty,
        # One string is one stop string, not its characters.
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(stop_token_ids),
        include_stop_str_in_output=include_stop_str_in_output,
        keep_special_tokens=keep_special_tokens,
        ignore_eos=ignore_eos,
        session_id=session_id,
        cache_salt=cache_salt,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=list(prompt_token_ids),
        tools=_tools(tools),
        parallel_tool_calls=parallel_tool_calls,
        chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
        continue_final_message=continue_final_message,
        bad_words=[bad_words] if isinstance(bad_words, str) else list(bad_words),  # one string is one word
        truncate_prompt_tokens=truncate_prompt_tokens,
        priority=priority,
        prediction=prediction,
    )
    if tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if draft:
        request.draft.CopyFrom(gateway_pb2.DraftOverrides(**draft))
    return request


def tokenize_request(
    prompt: str | None, messages: Iterable[MessageLike] | None, raw: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> gateway_pb2.TokenizeRequest:
    return gateway_pb2.TokenizeRequest(
        prompt=prompt or "", messages=[] if messages is None else [_message(m) for m in messages], raw=raw,
        tools=_tools(tools), chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
        continue_final_message=continue_final_message,
    )


def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[gateway_pb2.Tool]:
    """OpenAI-style tool definitions (or their "function" objects alone) as the contract's."""
    out = []
    for tool in tools or ():
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        out.append(gateway_pb2.Tool(function=gateway_pb2.Function(
            name=function.get("name", ""), description=function.get("description") or "",
            parameters="" if parameters is None else parameters if isinstance(parameters, str) else json.dumps(parameters),
            strict=bool(function.get("strict")),
        )))
    return out


def _tool_choice(choice: str | Mapping[str, Any]) -> gateway_pb2.ToolChoice:
    if isinstance(choice, str):
        return gateway_pb2.ToolChoice(mode=choice)
    function = choice.get("function", {})
    return gateway_pb2.ToolChoice(function=function.get("name", "") if isinstance(function, Mapping) else function)


def _structured_output(json_schema, regex, choice, grammar, json_object) -> common_pb2.StructuredOutput | None:
    """The one language asked for, if any (the message holds one: a second would replace the first)."""
    asked = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                                              ("grammar", grammar), ("json_object", json_object or None))
             if value is not None}
    if len(asked) > 1:
        raise TypeError(f"at most one of json_schema, regex, choice, grammar, json_object; got {', '.join(asked)}")
    if not asked:
        return None
    (name, value), = asked.items()
    if name == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if name == "choice":
        value = common_pb2.Choices(values=list(value))
    return common_pb2.StructuredOutput(**{name: value})


def _message(message: MessageLike) -> gateway_pb2.Message:
    if isinstance(message, Message):
        role, content, calls, call_id = message.role, message.content, message.tool_calls, message.tool_call_id
    else:
        role, content, call_id = message["role"], message.get("content") or "", message.get("tool_call_id", "")
        calls = [ToolCall(call["function"]["name"], call["function"]["arguments"], call.get("id", ""))
                 for call in message.get("tool_calls") or ()]
    if role not in ROLES:
        raise ValueError(f"message role {role!r}: expected one of {', '.join(ROLES)}")
    return gateway_pb2.Message(role=ROLES[role], content=content, tool_call_id=call_id, tool_calls=[
        gateway_pb2.ToolCall(id=call.id, function=gateway_pb2.FunctionCall(name=call.name, arguments=call.arguments))
        for call in calls])


def _fields(cls: type, message: Any, **nested: Any) -> Any:
    """A dataclass from the protobuf message fields of the same names."""
    return cls(**{f.name: nested[f.name] if f.name in nested else getattr(message, f.name) for f in fields(cls)})


def _logprobs(logprobs) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs))) for lp in logprobs)


def _tokens(response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    return {"token_ids": tuple(response.token_ids), "logprobs": _logprobs(response.logprobs),
            "prompt_token_ids": tuple(response.prompt_token_ids), "prompt_logprobs": _logprobs(response.prompt_logprobs),
            "tool_calls": tuple(ToolCall(call.function.name, call.function.arguments, call.id)
                                for call in response.tool_calls)}


def reply(response: gateway_pb2.GenerateResponse) -> Reply:
    return _fields(Reply, response, stats=_fields(Stats, response.stats), **_tokens(response))


def chunk(response: gateway_pb2.GenerateResponse) -> Chunk:
    stats = _fields(Stats, response.stats) if response.HasField("stats") else None
    return _fields(Chunk, response, stats=stats, **_tokens(response))


def served_model(served: gateway_pb2.ServedModel) -> ServedModel:
    return _fields(ServedModel, served, decoding=_fields(ParallelDecoding, served.decoding), generation_defaults={
        f.name: value for f, value in served.generation_defaults.ListFields()})


def error(rpc_error: grpc.RpcError) -> PardecError:
    code = rpc_error.code() if hasattr(rpc_error, "code") else None
    details = rpc_error.details() if hasattr(rpc_error, "details") else None
    return PardecError(code.name if code is not None else "UNKNOWN", details or str(rpc_error))


def credentials(
    tls: bool, ca: str | Path | None, cert: str | Path | None, key: str | Path | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials (None: plaintext); TLS without a CA file checks the system's roots."""
    if not tls and ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together (mutual TLS)")

    def read(path: str | Path | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert))


def with_request_id(call: dict[str, Any], request_id: str | None) -> dict[str, Any]:
    """``call``'s options with ``request_id`` as x-request-id metadata: the request's id in the
    gateway's log line and trace span (one line of at most 256 visible characters; else the
    gateway gives it a new one)."""
    if not request_id:
        return call
    return {**call, "metadata": (*(call["metadata"] or ()), ("x-request-id", request_id))}


def call_options(token: str | None, timeout: float | None, wait_for_ready: bool) -> dict[str, Any]:
    # Sent as plain metadata rather than call credentials, which gRPC refuses on a plaintext
    # channel, so that a token works on a loopback gateway without TLS too.
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    return {"timeout": timeout, "metadata": metadata, "wait_for_ready": wait_for_ready}
