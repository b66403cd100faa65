"""The `pardec` command: `pardec up` starts the whole stack, `pardec generate` asks it,
`pardec chat` holds a conversation with it, `pardec info` says what it serves."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import grpc
from google.protobuf import json_format

from pardec.drafter.redis_server import DEFAULT_MAXMEMORY, MAXMEMORY_POLICY
from pardec.runtime.errors import ConfigError
from pardec.runtime.limits import add_limit_flags, check_limits
from pardec.runtime.security import (
    BearerTokens, ServerTLS, add_server_tls_flags, client_tls, open_channel, read_tokens, server_tls_from_flags,
)
from pardec.runtime.serving import CHANNEL_OPTIONS, configure_logging
from pardec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pardec.verifier.config import parse_device

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_HTTP = "127.0.0.1:8000"  # where OpenAI-compatible clients look first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pardec", description="parallel-decoding LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start Redis, verifier, drafter(s) and gateway in the foreground")
    up.add_argument("--gateway-addr", default=DEFAULT_GATEWAY)
    up.add_argument("--config", help="MindIE-style config.json (default: embedded defaults)")
    up.add_argument("--model", help="GGUF file or Hugging Face checkpoint directory to serve (default: the config's "
                                    "modelWeightPath, else the bundled SmolLM2-135M-Instruct); wins over the config")
    up.add_argument("--drafters", type=int, default=1,
                    help="drafter replicas (0: the gateway drafts in its own process, one network hop fewer per step)")
    up.add_argument("--verifiers", type=int, default=1,
                    help="verifier replicas (each loads the model); a session moves if its replica dies")
    up.add_argument("--device", default="cpu",
                    help="where the verifier runs the model: cpu, cuda[:N] or npu[:N] (default cpu)")
    up.add_argument("--workdir", help="where sockets and ready files go (default: a temp dir)")
    up.add_argument("--metrics-addr", help="gateway Prometheus endpoint HOST:PORT (port 0 = any free port)")
    up.add_argument("--http-addr", default=DEFAULT_HTTP,
                    help=f"OpenAI-compatible HTTP API HOST:PORT (default {DEFAULT_HTTP}; port 0 = any free port; "
                         "'' = off)")
    up.add_argument("--shared-memory", action="store_true",
                    help="draft also from earlier requests' outputs (one memory per tenant and model)")
    up.add_argument("--overlap-drafting", choices=("auto", "on", "off"), default="auto",
                    help="draft the next step's tree while the verifier runs this one (auto: when not on CPU)")
    add_server_tls_flags(up, "the gateway's public port")
    up.add_argument("--internal-tls-cert", help="PEM certificate for mutual TLS between gateway, verifier, drafters")
    up.add_argument("--internal-tls-key", help="PEM key of --internal-tls-cert")
    up.add_argument("--internal-tls-ca", help="PEM CA that --internal-tls-cert chains to")
    up.add_argument("--token", action="append", default=[], metavar="TENANT=TOKEN",
                    help="require bearer tokens at the gateway; this one names TENANT (repeatable)")
    up.add_argument("--tokens-file", help='JSON {"TOKEN": "TENANT", ...}: bearer tokens and their tenants')
    add_limit_flags(up, "gateway", public=True)
    up.add_argument("--redis-maxmemory", default=DEFAULT_MAXMEMORY,
                    help=f"memory bound of the Redis it starts (Redis units; default {DEFAULT_MAXMEMORY}, "
                         f"policy {MAXMEMORY_POLICY}: drafting state is evicted, never the service)")
    up.add_argument("--log-level", default="INFO")
    up.set_defaults(run=_up)

    generate = commands.add_parser("generate", help="send one request to a running gateway")
    generate.add_argument("prompt", nargs="?", default="", help="the user message (after --messages' turns)")
    generate.add_argument("--system", help="a system message first")
    generate.add_argument("--messages", metavar="FILE",
                          help='a conversation: JSON [{"role": "system"|"user"|"assistant", "content": ...}, ...]')
    generate.add_argument("--raw", action="store_true", help="a raw completion: the prompt as text, no chat template")
    generate.add_argument("--plain", action="store_true", help="DECODING_MODE_PLAIN: no drafting")
    generate.add_argument("--json", action="store_true", help="print the response as JSON")
    generate.add_argument("--stream", action="store_true", help="GenerateStream: print text as it is committed")
    _add_request_flags(generate)
    generate.add_argument("--session-id", default="", help="multi-turn drafting memory (scoped to your tenant)")
    _add_client_flags(generate, timeout_s=600.0)
    generate.set_defaults(run=_generate)

    chat = commands.add_parser("chat", help="an interactive conversation with a running gateway")
    chat.add_argument("--system", help="a system message first (default: the model's own)")
    chat.add_argument("--plain", action="store_true", help="DECODING_MODE_PLAIN: no drafting")
    _add_request_flags(chat)
    chat.add_argument("--session-id", default="",
                      help="the conversation's drafting memory (default: a new one per conversation)")
    _add_client_flags(chat, timeout_s=600.0)
    chat.set_defaults(run=_chat)

    info = commands.add_parser("info", help="print what a running gateway serves: model, limits, decoding")
    info.add_argument("--json", action="store_true", help="print the reply as JSON")
    _add_client_flags(info, timeout_s=60.0)
    info.set_defaults(run=_info)

    bench = commands.add_parser(
        "bench", add_help=False, help="benchmark parallel decoding on this machine (see `pardec bench --help`)"
    )
    bench.set_defaults(run=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from pardec.bench.run import main as bench_main  # needs the `bench` extra

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


def _up(args) -> int:
    from pardec.gateway.mindie import load_mindie_config
    from pardec.gateway.stack import Stack

    configure_logging(args.log_level)
    try:
        settings = load_mindie_config(args.config)
        if args.model:
            settings = settings.serving(args.model)
        parse_device(args.device)
        tls = server_tls_from_flags(args)
        internal = (args.internal_tls_cert, args.internal_tls_key, args.internal_tls_ca)
        internal_tls = ServerTLS(*internal) if any(internal) else None
        if internal_tls is not None and not internal_tls.mutual:
            raise ConfigError("--internal-tls-ca: required with --internal-tls-cert (internal hops use mutual TLS)")
        tokens = read_tokens(args.token, args.tokens_file)
        BearerTokens.from_mapping(tokens)  # refuses bad tokens here, before anything starts
        check_limits(args.max_concurrent_rpcs, args.max_message_bytes)
        http_addr = args.http_addr or None
        if http_addr and tls is not None and tls.mutual and not tokens:
            # Tenants named by client certificates are not read on the HTTP API (gateway/server.py).
            if http_addr != DEFAULT_HTTP:
                raise ConfigError("--http-addr: with --tls-client-ca and no bearer tokens, tenants are named by client "
                                  "certificates, which the HTTP API does not read; add --tokens-file")
            print("pardec up: the HTTP API is off (mutual TLS without bearer tokens)", file=sys.stderr)
            http_addr = None
    except ConfigError as error:
        print(f"pardec up: configuration error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="pardec-") as tmp:
        workdir = Path(args.workdir or tmp)
        tokens_file = _write_private_json(workdir / "tokens.json", tokens) if tokens else None
        stack = Stack(
            workdir,
            settings,
            gateway_addr=args.gateway_addr,
            drafters=args.drafters,
            verifiers=args.verifiers,
            redis_url=os.environ.get("REDIS_URL"),
            config_path=args.config,
            metrics_addr=args.metrics_addr,
            log_level=args.log_level,
            tls=tls,
            internal_tls=internal_tls,
            tokens_file=tokens_file,
            shared_memory=args.shared_memory,
            device=args.device,
            gateway_limits=(args.max_concurrent_rpcs, args.max_message_bytes),
            redis_maxmemory=args.redis_maxmemory,
            http_addr=http_addr,
            gateway_flags=("--overlap-drafting", args.overlap_drafting),
        )
        try:
            stack.start()
        except RuntimeError as error:  # a service refused its configuration (it printed why)
            print(f"pardec up: {error}", file=sys.stderr)
            return 2
        metrics = stack.addresses.get("gateway-metrics")
        if stack.http_address:
            print(f"OpenAI-compatible API on {'https' if tls else 'http'}://{stack.http_address}/v1", flush=True)
        if metrics:
            print(f"metrics on http://{metrics}/metrics", flush=True)
        # Last, and in this form: scripts wait for this line and read the address after "gateway on".
        print(f"pardec is up: gateway on {stack.gateway_address} (Ctrl-C to stop)", flush=True)
        try:
            stack.wait(stop)
        finally:
            stack.stop()
    return 0


def _write_private_json(path: Path, value) -> str:
    """The gateway gets its tokens through a 0600 file, never on a command line (ps shows those)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(value, file)
    return str(path)


def _add_request_flags(parser: argparse.ArgumentParser) -> None:
    """A request's settings, the same for `pardec generate` and `pardec chat`."""
    parser.add_argument("--max-decoding-length", type=int, help="per-request cap on decoding_length")
    parser.add_argument("--max-new-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _request(args, **fields) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest of the request flags (_add_request_flags), with ``fields`` set too."""
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if args.plain else gateway_pb2.DECODING_MODE_DEFAULT,
        sampling=sampling,
        stop=args.stop,
        **fields,
    )
    if args.max_decoding_length is not None:
        request.draft.decoding_length = args.max_decoding_length
    return request


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
    chat = Chat(_request(args), system=args.system, session_id=args.session_id)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"pardec chat on {args.addr}; {HELP}", file=sys.stderr)
    with channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = _call_options(args)
        return run(chat, lambda request: stub.GenerateStream(request, **call), prompt="> " if interactive else "")


def _generate(args) -> int:
    try:
        messages = _messages(args)
    except (OSError, ValueError) as error:
        print(f"pardec generate: --messages: {error}", file=sys.stderr)
        return 2
    request = _request(
        args, prompt="" if messages else args.prompt, messages=messages, raw=args.raw, session_id=args.session_id
    )
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
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    stats = reply.stats
    if not args.stream:
        print(reply.text)
    print(
        f"\n[{reply.model}, {stats.decoding_method}] {len(reply.token_ids)} tokens, finish={reply.finish_reason}, "
        f"steps={stats.steps}, mean accepted length={stats.mean_accepted_length:.2f}, "
        f"drafts {stats.accepted_draft_tokens}/{stats.draft_tokens} accepted, "
        f"ttft={stats.ttft_ms:.0f} ms, total={stats.total_ms:.0f} ms "
        f"({1e3 * len(reply.token_ids) / max(stats.total_ms, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _messages(args) -> list[gateway_pb2.Message]:
    """--system, --messages' turns and the prompt as one conversation; none of them: [] (prompt)."""
    turns = []
    if args.messages:
        with open(args.messages, encoding="utf-8") as f:
            turns = json.load(f)
        if not isinstance(turns, list) or not all(isinstance(t, dict) and set(t) == {"role", "content"} for t in turns):
            raise ValueError('expected a JSON list of {"role": ..., "content": ...}')
    if args.system is None and not turns:
        return []
    turns = [*([{"role": "system", "content": args.system}] if args.system is not None else []), *turns]
    if args.prompt:
        turns.append({"role": "user", "content": args.prompt})
    roles = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT}
    for turn in turns:
        if turn["role"] not in roles or not isinstance(turn["content"], str):
            raise ValueError(f"{turn!r}: the role is system, user or assistant; the content a string")
    return [gateway_pb2.Message(role=roles[t["role"]], content=t["content"]) for t in turns]


def _add_client_flags(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """How a command reaches a running gateway: its address, bearer token and TLS."""
    parser.add_argument("--addr", default=DEFAULT_GATEWAY, help="gateway address")
    parser.add_argument("--token", default=os.environ.get("PARDEC_TOKEN"), help="bearer token (default: $PARDEC_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM CA the gateway's certificate must chain to (connects over TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a gateway that requires one (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    parser.add_argument("--timeout", type=float, default=timeout_s)


def _call_options(args) -> dict:
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    # Waits for a gateway that is still starting (`pardec up & pardec generate ...`).
    return {"timeout": args.timeout, "wait_for_ready": True, "metadata": metadata}


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
    ]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _print_stream(chunks) -> gateway_pb2.GenerateResponse:
    """Prints each chunk's text as it arrives; returns the whole response, as Generate would."""
    whole = gateway_pb2.GenerateResponse()
    for chunk in chunks:
        print(chunk.text, end="", flush=True)
        whole.text += chunk.text
        whole.token_ids.extend(chunk.token_ids)
        whole.model = chunk.model
        if chunk.finish_reason:
            whole.finish_reason = chunk.finish_reason
            whole.stats.CopyFrom(chunk.stats)
    print()
    return whole


if __name__ == "__main__":
    sys.exit(main())
