"""A request from the command line: the flags `pardec generate` and `pardec chat` share, and
generate's conversation (--system, --messages), structured output and tools, as the
GenerateRequest the gateway checks (gateway/cli.py sends it)."""

from __future__ import annotations

import argparse
import json

from pardec.v1 import common_pb2, gateway_pb2


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """A request's settings, the same for `pardec generate` and `pardec chat`."""
    parser.add_argument("--max-decoding-length", type=_tokens, help="per-request cap on decoding_length")
    parser.add_argument("--max-new-tokens", type=_tokens, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; with --plain")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; with --plain")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=token_id, action="append", default=[], dest="stop_token_ids",
                        help="stop at this token id too (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past end of sequence, to --max-new-tokens")
    parser.add_argument("--cache-salt", default="",
                        help="reuse cached prompt prefixes only among requests with the same salt (and tenant)")
    parser.add_argument("--chat-template-kwargs", default="", metavar="JSON",
                        help='the chat template\'s own variables, e.g. \'{"enable_thinking": false}\' (Qwen3)')
    parser.add_argument("--thinking-budget", type=_tokens, metavar="N",
                        help="a thinking model's thinking bounded: </think> is forced after N tokens of it")
    parser.add_argument("--bad-word", action="append", default=[], dest="bad_words",
                        help="a word never generated, as written and after a space (repeatable)")
    parser.add_argument("--prediction-file", metavar="PATH",
                        help="text the answer will mostly be (a file to edit): drafted from, never changing a token")


def _tokens(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{value} is not a number of tokens (an integer >= 0)")
    return value


def token_id(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is not a token id (an integer >= 0)")
    return value


def request_of(args, **fields) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest of the request flags (add_request_flags), with ``fields`` set too."""
    sampling = common_pb2.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    if args.thinking_budget is not None:  # the gateway reads where the thinking starts from the template
        sampling.thinking_budget.tokens = args.thinking_budget
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if args.plain else gateway_pb2.DECODING_MODE_DEFAULT,
        sampling=sampling,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        cache_salt=args.cache_salt,
        chat_template_kwargs=args.chat_template_kwargs,
        bad_words=args.bad_words,
        **fields,
    )
    if args.prediction_file:
        with open(args.prediction_file, encoding="utf-8") as f:
            request.prediction = f.read()
    if args.max_decoding_length is not None:
        request.draft.decoding_length = args.max_decoding_length
    return request


def structured_output(args) -> common_pb2.StructuredOutput | None:
    """The language --json-schema, --regex, --choice, --grammar or --json-object names (at most one)."""
    for flag in ("json_schema", "grammar"):
        if getattr(args, flag):
            with open(getattr(args, flag), encoding="utf-8") as f:
                return common_pb2.StructuredOutput(**{flag: f.read()})
    if args.regex is not None:
        return common_pb2.StructuredOutput(regex=args.regex)
    if args.choice:
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(values=args.choice))
    return common_pb2.StructuredOutput(json_object=True) if args.json_object else None


def messages_of(args) -> list[gateway_pb2.Message]:
    """--system, --messages' turns and the prompt as one conversation; none of them: [] (prompt)."""
    turns = []
    if args.messages:
        with open(args.messages, encoding="utf-8") as f:
            turns = json.load(f)
        if not isinstance(turns, list) or not all(isinstance(t, dict) and {"role", "content"} <= set(t) <= _TURN_KEYS
                                                  for t in turns):
            raise ValueError('expected a JSON list of {"role": ..., "content": ...} (and "tool_calls", "tool_call_id")')
    if args.system is None and not turns:
        return []
    turns = [*([{"role": "system", "content": args.system}] if args.system is not None else []), *turns]
    if args.prompt:
        turns.append({"role": "user", "content": args.prompt})
    return [_message(turn) for turn in turns]


_ROLES = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT,
          "tool": gateway_pb2.ROLE_TOOL}
_TURN_KEYS = {"role", "content", "tool_calls", "tool_call_id"}


def _message(turn: dict) -> gateway_pb2.Message:
    """One turn, as OpenAI's chat messages write it; the gateway checks how the turns fit together."""
    content, calls = turn["content"], turn.get("tool_calls") or []
    if turn["role"] not in _ROLES or not (isinstance(content, str) or content is None and calls):
        raise ValueError(f"{turn!r}: the role is system, user, assistant or tool; the content a string (null only "
                         "beside tool_calls)")
    try:
        made = [gateway_pb2.ToolCall(id=call["id"], function=gateway_pb2.FunctionCall(
            name=call["function"]["name"], arguments=call["function"]["arguments"])) for call in calls]
    except (KeyError, TypeError):
        raise ValueError(f'{turn!r}: each tool call is {{"id": ..., "function": {{"name": ..., "arguments": '
                         '"<JSON text>"}}') from None
    return gateway_pb2.Message(role=_ROLES[turn["role"]], content=content or "", tool_calls=made,
                               tool_call_id=turn.get("tool_call_id", ""))


def tools_of(args) -> dict:
    """--tools, --tool-choice and --one-tool-call as GenerateRequest fields (the gateway checks them)."""
    if not args.tools:
        if args.tool_choice or args.one_tool_call:
            raise ValueError("--tool-choice and --one-tool-call need --tools")
        return {}
    with open(args.tools, encoding="utf-8") as f:
        tools = json.load(f)
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        raise ValueError('expected a JSON list of {"type": "function", "function": {"name": ..., ...}}')
    functions = [tool["function"] for tool in tools]
    fields = {"tools": [gateway_pb2.Tool(function=gateway_pb2.Function(
        name=str(function.get("name", "")), description=str(function.get("description", "")),
        parameters=json.dumps(function["parameters"]) if "parameters" in function else "")) for function in functions]}
    choice = args.tool_choice or ""
    if choice:
        fields["tool_choice"] = gateway_pb2.ToolChoice(
            **{"mode": choice} if choice in ("auto", "none", "required") else {"function": choice})
    if args.one_tool_call:
        fields["parallel_tool_calls"] = False
    return fields
