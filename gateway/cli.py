"""The `pardec` command: `pardec up` starts the whole stack (gateway/cli_up.py), `pardec
generate` asks it, `pardec chat` holds a conversation with it, `pardec info` says what it serves,
`pardec run-batch` runs a file of requests through it (gateway/cli_batch.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf import json_format

from pardec.gateway.cli_batch import add_batch_command
from pardec.gateway.cli_request import add_request_flags, messages_of, request_of, structured_output, tools_of
from pardec.gateway.cli_up import DEFAULT_GATEWAY, add_up_command
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import client_tls, open_channel
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pardec", description="parallel-decoding LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)

    add_up_command(commands)

    generate = commands.add_parser("generate", help="send one request to a running gateway")
    generate.add_argument("prompt", nargs="?", default="", help="the user message (after --messages' turns)")
    generate.add_argument("--system", help="a system message first")
    generate.add_argument("--messages", metavar="FILE",
                          help='a conversation: JSON [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, '
                               '...], with OpenAI\'s "tool_calls" and "tool_call_id" where tools were called')
    generate.add_argument("--raw", action="store_true", help="a raw completion: the prompt as text, no chat template")
    generate.add_argument("--plain", action="store_true", help="DECODING_MODE_PLAIN: no drafting")
    generate.add_argument("--json", action="store_true", help="print the response as JSON")
    generate.add_argument("--stream", action="store_true", help="GenerateStream: print text as it is committed")
    generate.add_argument("--logprobs", type=int, metavar="N",
                          help="print each token's log-probability and the N likeliest beside it (with --plain)")
    add_request_flags(generate)
    language = generate.add_mutually_exclusive_group()
    language.add_argument("--json-schema", metavar="FILE", help="the answer is one JSON value this schema validates")
    language.add_argument("--regex", help="the answer matches this regular expression (Rust syntax)")
    language.add_argument("--choice", action="append", help="the answer is one of these strings (repeatable)")
    language.add_argument("--grammar", metavar="FILE", help="the answer is a word of this Lark grammar")
    language.add_argument("--json-object", action="store_true", help="the answer is one JSON object")
    generate.add_argument("--tools", metavar="FILE", help='functions the model may call: JSON [{"type": "function", '
                          '"function": {"name": ..., "description": ..., "parameters": {JSON Schema}}}, ...]')
    generate.add_argument("--tool-choice", help='"auto" (the default with --tools), "none", "required", or the name '
                          'of the one function to call')
    generate.add_argument("--one-tool-call", action="store_true", help="at most one call (parallel_tool_calls off)")
    generate.add_argument("--session-id", default="", help="multi-turn drafting memory (scoped to your tenant)")
    generate.add_argument("--request-id", help="the request's id in the gateway's log line and trace span "
                                               "(x-request-id; default: a new one)")
    _add_client_flags(generate, timeout_s=600.0)
    generate.set_defaults(run=_generate)

    chat = commands.add_parser("chat", help="an interactive conversation with a running gateway")
    chat.add_argument("--system", help="a system message first (default: the model's own)")
    chat.add_argument("--plain", action="store_true", help="DECODING_MODE_PLAIN: no drafting")
    add_request_flags(chat)
    chat.add_argument("--session-id", default="",
                      help="the conversation's drafting memory (default: a new one per conversation)")
    _add_client_flags(chat, timeout_s=600.0)
    chat.set_defaults(run=_chat)

    info = commands.add_parser("info", help="print what a running gateway serves: model, limits, decoding")
    info.add_argument("--json", action="store_true", help="print the reply as JSON")
    _add_client_flags(info, timeout_s=60.0)
    info.set_defaults(run=_info)

    add_batch_command(commands)

    bench = commands.add_parser(
        "bench", add_help=False, help="benchmark parallel decoding on this machine (see `pardec bench --help`); "
        "`pardec bench serve`: measure a running server (see `pardec bench serve --help`)"
    )
    bench.set_defaults(run=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench" and rest[:1] == ["serve"]:
        from pardec.bench.serve import main as serve_main  # measures a running server; no extra needed

        return serve_main(rest[1:])
    if args.command == "bench":
        from pardec.bench.run import main as bench_main  # needs the `bench` extra

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


def _channel(args, command: str) -> grpc.Channel | None:
    """The channel to the gateway of the client flags; None (after saying why) for bad TLS flags."""
    try:
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    except ConfigError as error:
        print(f"pardec {command}: {error}", file=sys.stderr)
        return None
    return open_channel(args.addr, tls, CHANNEL_OPTIONS)


def _chat(args) -> int:
    from pardec.gateway.chat_loop import HELP, Chat, run

    channel = _channel(args, "chat")
    if channel is None:
        return 2
    try:
        chat = Chat(request_of(args), system=args.system, session_id=args.session_id)
    except (OSError, ValueError) as error:  # --prediction-file unreadable, --max-new-tokens -1
        print(f"pardec chat: {error}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"pardec chat on {args.addr}; {HELP}", file=sys.stderr)
    with channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = _call_options(args)
        return run(chat, lambda request: stub.GenerateStream(request, **call), prompt="> " if interactive else "")


def _generate(args) -> int:
    try:
        messages = messages_of(args)
    except (OSError, ValueError) as error:
        print(f"pardec generate: --messages: {error}", file=sys.stderr)
        return 2
    try:
        tools = tools_of(args)
    except (OSError, ValueError) as error:
        print(f"pardec generate: --tools: {error}", file=sys.stderr)
        return 2
    try:
        request = request_of(
            args, prompt="" if messages else args.prompt, messages=messages, raw=args.raw, session_id=args.session_id,
            logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, **tools,
        )
    except (OSError, ValueError) as error:  # --prediction-file unreadable, --max-new-tokens -1
        print(f"pardec generate: {error}", file=sys.stderr)
        return 2
    try:
        language = structured_output(args)
    except OSError as error:
        print(f"pardec generate: {error}", file=sys.stderr)
        return 2
    if language is not None:
        request.sampling.structured_output.CopyFrom(language)
    channel = _channel(args, "generate")
    if channel is None:
        return 2
    with channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = _call_options(args)
        try:
            if args.stream and not args.json:
                reply = _print_stream(stub.GenerateStream(request, **call))
            else:
                reply = stub.Generate(request, **call)
            if reply.logprobs and not args.json:
                _print_logprobs(stub, call, reply)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    stats = reply.stats
    if not args.stream:
        if reply.reasoning_content:  # a thinking model's thinking: beside the answer, not in it
            print(f"[thinking] {reply.reasoning_content}", file=sys.stderr)
        print(reply.text)
    for call in reply.tool_calls:
        print(f"[tool call {call.id}] {call.function.name}({call.function.arguments})")
    predicted = stats.accepted_prediction_tokens + stats.rejected_prediction_tokens
    predicted = f"prediction {stats.accepted_prediction_tokens}/{predicted} tokens appeared, " if predicted else ""
    print(
        f"\n[{reply.model}, {stats.decoding_method}] {len(reply.token_ids)} tokens, finish={reply.finish_reason}, "
        f"steps={stats.steps}, mean accepted length={stats.mean_accepted_length:.2f}, "
        f"drafts {stats.accepted_draft_tokens}/{stats.draft_tokens} accepted, "
        f"{stats.cached_prompt_tokens}/{stats.prompt_tokens} prompt tokens cached, "
        f"{predicted}ttft={stats.ttft_ms:.0f} ms, total={stats.total_ms:.0f} ms "
        f"({1e3 * len(reply.token_ids) / max(stats.total_ms, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _add_client_flags(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """How a command reaches a running gateway: its address, bearer token and TLS."""
    parser.add_argument("--addr", default=DEFAULT_GATEWAY, help="gateway address")
    parser.add_argument("--token", default=os.environ.get("PARDEC_TOKEN"), help="bearer token (default: $PARDEC_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM CA the gateway's certificate must chain to (connects over TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a gateway that requires one (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    parser.add_argument("--timeout", type=float, default=timeout_s)


def _call_options(args) -> dict:
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    if getattr(args, "request_id", None):  # generate's
        metadata += (("x-request-id", args.request_id),)
    # Waits for a gateway that is still starting (`pardec up & pardec generate ...`).
    return {"timeout": args.timeout, "wait_for_ready": True, "metadata": metadata or None}


def _info(args) -> int:
    channel = _channel(args, "info")
    if channel is None:
        return 2
    with channel:
        try:
            served = gateway_pb2_grpc.GatewayStub(channel).GetServedModel(
                gateway_pb2.GetServedModelRequest(), **_call_options(args)
            )
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if args.json:
        reply = json_format.MessageToDict(served, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps(reply, indent=2))
        return 0
    for name, value in describe(served):
        print(f"{name + ':':<19} {value}")
    return 0


def describe(served: gateway_pb2.ServedModel) -> list[tuple[str, str]]:
    """`pardec info`'s lines: (name, value)."""
    decoding = served.decoding
    if decoding.method == "memory_decoding":
        settings = f"decoding_length {decoding.decoding_length}, dynamic_algo {_on(decoding.dynamic_algo)}"
    elif decoding.method == "la":
        settings = f"level {decoding.level}, window {decoding.window}, guess_set_size {decoding.guess_set_size}"
    else:
        settings = ""
    if settings:
        settings = f" ({settings}, speculationGamma {decoding.speculation_gamma}, " \
                   f"shared memory {_on(decoding.shared_memory)})"
    return [
        ("model", served.model),
        ("architecture", served.architecture),
        ("quantization", served.quantization),
        ("device", served.device or "unknown"),
        ("verifier replicas", str(served.verifier_replicas)),
        ("context", f"{served.max_seq_len} tokens (maxSeqLen), prompt at most {served.max_input_tokens} "
                    f"(truncation {_on(served.truncation)})"),
        ("max_new_tokens", f"default {served.default_max_new_tokens}, at most {served.max_new_tokens_limit}"),
        ("vocabulary", f"{served.vocab_size} tokens"),
        ("chat template", "applied to prompts (unless raw) and messages" if served.chat_template else "none"),
        ("decoding", decoding.method + settings),
        ("prefix caching", f"on, blocks of {served.prefix_block_tokens} tokens" if served.prefix_block_tokens else "off"),
        ("KV cache", f"{served.kv_cache_dtype or 'unknown'} (attention {served.attention or 'unknown'})"),
        ("embedding", f"{served.embedding_dtype or 'unknown'}"
                      f"{' (rounded to it)' if served.embedding_rounded else ''}"),
        ("tool calls", f"{served.tool_call_layout} layout" if served.tool_call_layout else "unknown"),
        ("HTTP sampling defaults", ", ".join(f"{field.name} {value:g}" for field, value in
                                             served.generation_defaults.ListFields()) or "the APIs' own"),
    ]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _print_stream(chunks) -> gateway_pb2.GenerateResponse:
    """Prints each chunk's text as it arrives; returns the whole response, as Generate would."""
    whole = gateway_pb2.GenerateResponse()
    for chunk in chunks:
        if chunk.reasoning_content:
            print(chunk.reasoning_content, end="", file=sys.stderr, flush=True)
        whole.reasoning_content += chunk.reasoning_content
        print(chunk.text, end="", flush=True)
        whole.text += chunk.text
        whole.token_ids.extend(chunk.token_ids)
        whole.logprobs.extend(chunk.logprobs)
        whole.tool_calls.extend(chunk.tool_calls)
        whole.model = chunk.model
        if chunk.finish_reason:
            whole.finish_reason = chunk.finish_reason
            whole.stats.CopyFrom(chunk.stats)
    print()
    return whole


def _print_logprobs(stub, call: dict, reply: gateway_pb2.GenerateResponse) -> None:
    """One line per generated token: its text, log-probability and the likeliest tokens'."""
    ids = sorted({*reply.token_ids, *(t for lp in reply.logprobs for t in lp.top_token_ids)})
    texts = {i: stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=[i]), **call).text for i in ids}
    print("\ntoken\tlogprob\tlikeliest")
    for token, logprob in zip(reply.token_ids, reply.logprobs):
        top = ", ".join(f"{texts[t]!r} {lp:.3f}" for t, lp in zip(logprob.top_token_ids, logprob.top_logprobs))
        print(f"{texts[token]!r}\t{logprob.logprob:.3f}\t{top}")


if __name__ == "__main__":
    sys.exit(main())
