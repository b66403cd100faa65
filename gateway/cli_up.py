"""`pardec up`: the whole stack in the foreground (Redis, verifier and drafter replicas, the
gateway with its gRPC and OpenAI-compatible HTTP APIs), on embedded defaults or MindIE's
config.json, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from pardec.drafter.redis_server import DEFAULT_MAXMEMORY, MAXMEMORY_POLICY
from pardec.gateway.http_options import HttpOptions, add_http_flags, http_options_from_flags
from pardec.runtime.errors import ConfigError
from pardec.runtime.limits import add_limit_flags, check_limits
from pardec.runtime.security import BearerTokens, ServerTLS, add_server_tls_flags, read_tokens, server_tls_from_flags
from pardec.runtime.serving import configure_logging
from pardec.runtime.tracing import check_endpoint
from pardec.verifier.generation_config import SETTINGS as GENERATION_SETTINGS
from pardec.verifier.config import EMBEDDING_DTYPES, KV_CACHE_DTYPES, VerifierConfig, parse_device, read_chat_template

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_HTTP = "127.0.0.1:8000"  # where OpenAI-compatible clients look first


def add_up_command(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="start Redis, verifier, drafter(s) and gateway in the foreground")
    up.add_argument("--gateway-addr", default=DEFAULT_GATEWAY)
    up.add_argument("--config", help="MindIE-style config.json (default: embedded defaults)")
    up.add_argument("--model", help="GGUF file or Hugging Face checkpoint directory to serve (default: the config's "
                                    "modelWeightPath, else the bundled SmolLM2-135M-Instruct); wins over the config")
    up.add_argument("--served-model-name", help="the model's name in replies and the OpenAI API's model (default: the "
                                                "config's modelName, else the checkpoint's); wins over the config")
    up.add_argument("--chat-template", default="", metavar="FILE",
                    help="a Jinja chat template file (or the template's text) the verifiers serve in place of the "
                         "model's own")
    up.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                    help="HTTP requests' default sampling: the model directory's generation_config.json, else its "
                         "config.json's (auto), "
                         "none, or the one in DIR")
    up.add_argument("--drafters", type=int, default=1,
                    help="drafter replicas (0: the gateway drafts in its own process, one network hop fewer per step)")
    up.add_argument("--verifiers", type=int, default=1,
                    help="verifier replicas (each loads the model); a session moves if its replica dies")
    up.add_argument("--device", default="cpu",
                    help="where the verifier runs the model: cpu, cuda[:N] or npu[:N] (default cpu)")
    up.add_argument("--workdir", help="where sockets and ready files go (default: a temp dir)")
    up.add_argument("--metrics-addr", help="gateway Prometheus endpoint HOST:PORT (port 0 = any free port)")
    up.add_argument("--http-addr", default=None,
                    help=f"OpenAI-compatible HTTP API HOST:PORT (default {DEFAULT_HTTP}; port 0 = any free port; "
                         "'' = off)")
    add_http_flags(up)
    up.add_argument("--shared-memory", action="store_true",
                    help="draft also from earlier requests' outputs (one memory per tenant and model)")
    up.add_argument("--no-prefix-caching", action="store_true",
                    help="verifiers keep no finished prompt's KV blocks for the next request that starts the same way")
    up.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="what the verifiers' KV pools store: auto (fp32 on CPU, bf16 in the GPU's device engine), "
                         "bfloat16 (half the memory per token on CPU), float32 (not in the device engine)")
    up.add_argument("--embedding-dtype", choices=EMBEDDING_DTYPES, default="auto",
                    help="what the verifiers keep the embedding table in: auto (bf16 or fp16 where exact: a checkpoint "
                         "used as stored; else fp32), bfloat16 (half a prepared table's memory, each entry rounded), float32")
    up.add_argument("--otlp-traces-endpoint", default="",
                    help="the gateway sends a span per request, the verifiers one per prefill, to this OpenTelemetry "
                         "collector (OTLP/gRPC HOST:PORT)")
    up.add_argument("--enable-log-requests", action="store_true",
                    help="the gateway logs a line per request once it ends (its id, status, tokens, steps, times)")
    up.add_argument("--disable-log-stats", action="store_true",
                    help="the gateway logs no line of its load (by default one every 10 s while requests run)")
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
    vllm = up.add_argument_group("vLLM's names", "the same settings as `vllm serve` names them")
    vllm.add_argument("--host", help=f"the HTTP API's host (with --port; default {DEFAULT_HTTP.rpartition(':')[0]})")
    vllm.add_argument("--port", type=int, help=f"the HTTP API's port (default {DEFAULT_HTTP.rpartition(':')[2]}; "
                                                "--http-addr HOST:PORT in one)")
    vllm.add_argument("--api-key", action="append", default=[], metavar="KEY",
                      help="require this bearer token (repeatable): --token api-key=KEY, the tenant api-key")
    vllm.add_argument("--max-model-len", type=int, metavar="N",
                      help="positions a sequence may hold, prompt and answer: maxSeqLen N and maxInputTokenLen N - 1, "
                           "over the config's")
    up.set_defaults(run=_up)


def _http_address(args) -> tuple[str | None, bool]:
    """(the HTTP API's address, None when off; whether the command line asked for it): --http-addr,
    or --host and --port (vLLM's) in its place."""
    if args.host is None and args.port is None:
        return (DEFAULT_HTTP if args.http_addr is None else args.http_addr) or None, args.http_addr is not None
    if args.http_addr is not None:
        raise ConfigError("--host/--port: they say what --http-addr says; give one or the other")
    default_host, _, default_port = DEFAULT_HTTP.rpartition(":")
    port = int(default_port) if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: must be in [0, 65535] (0: any free port), got {port}")
    host = default_host if args.host is None else args.host.removeprefix("[").removesuffix("]")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"--host: a host name or an address, without a port (that is --port), got {host!r}") \
                from None
        return f"[{host}]:{port}", True
    return f"{host}:{port}", True  # an empty host: every interface, as --http-addr :PORT says


def _up(args) -> int:
    from pardec.gateway.mindie import load_mindie_config
    from pardec.gateway.stack import Stopped

    configure_logging(args.log_level)
    try:
        settings = load_mindie_config(args.config)
        if args.model:
            settings = settings.serving(args.model)
        if args.served_model_name:
            settings = settings.named(args.served_model_name)
        if args.max_model_len is not None:
            settings = settings.bounded(args.max_model_len, from_file=bool(args.config))
        parse_device(args.device)
        template = VerifierConfig(chat_template=read_chat_template(args.chat_template),
                                  generation_config=args.generation_config).chat_template  # checked now
        tls = server_tls_from_flags(args)
        internal = (args.internal_tls_cert, args.internal_tls_key, args.internal_tls_ca)
        internal_tls = ServerTLS(*internal) if any(internal) else None
        if internal_tls is not None and not internal_tls.mutual:
            raise ConfigError("--internal-tls-ca: required with --internal-tls-cert (internal hops use mutual TLS)")
        tokens = read_tokens([*args.token, *(f"api-key={key}" for key in args.api_key)], args.tokens_file)
        try:
            BearerTokens.from_mapping(tokens)  # refuses bad tokens here, before anything starts
        except ConfigError as error:
            raise ConfigError(f"--api-key: {error}" if "'api-key'" in str(error) else str(error)) from None
        check_limits(args.max_concurrent_rpcs, args.max_message_bytes)
        check_endpoint(args.otlp_traces_endpoint)  # refused here, before anything starts
        http_addr, asked = _http_address(args)
        if http_addr and tls is not None and tls.mutual and not tokens:
            # Tenants named by client certificates are not read on the HTTP API (gateway/server.py).
            if asked:
                raise ConfigError("--http-addr (--host/--port): with --tls-client-ca and no bearer tokens, tenants are "
                                  "named by client certificates, which the HTTP API does not read; add --tokens-file")
            print("pardec up: the HTTP API is off (mutual TLS without bearer tokens)", file=sys.stderr)
            http_addr = None
        http_options = http_options_from_flags(args)
        if http_addr is None and http_options != HttpOptions():
            raise ConfigError("--allowed-origins, --enable-request-id-headers, ...: options of the HTTP API, which is off")
    except ConfigError as error:
        print(f"pardec up: configuration error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="pardec-") as tmp:
        workdir = Path(args.workdir or tmp)
        tokens_file = _write_private_json(workdir / "tokens.json", tokens) if tokens else None
        try:
            stack = _stack(args, workdir, settings, tls, internal_tls, tokens_file, http_addr, http_options, template)
        except ConfigError as error:  # --drafters -1, --verifiers 0
            print(f"pardec up: configuration error: {error}", file=sys.stderr)
            return 2
        try:
            stack.start(stop)
        except Stopped as error:
            print(f"pardec up: {error}; stopped", file=sys.stderr)
            return 0
        except (RuntimeError, ValueError, TimeoutError) as error:  # a service refused its configuration (it
            print(f"pardec up: {error}", file=sys.stderr)  # printed why), a workdir too long for a socket, ...
            return 1 if isinstance(error, TimeoutError) else 2
        metrics = stack.addresses.get("gateway-metrics")
        if stack.http_address:
            print(f"OpenAI-compatible API on {'https' if tls else 'http'}://{stack.http_address}/v1", flush=True)
        if metrics:
            print(f"metrics on http://{metrics}/metrics", flush=True)
        # Last, and in this form: scripts wait for this line and read the address after "gateway on".
        print(f"pardec is up: gateway on {stack.gateway_address} (Ctrl-C to stop)", flush=True)
        try:
            crashed = stack.wait(stop)
        finally:
            stack.stop()
    return 1 if crashed else 0  # a service that died is a failure to whatever supervises pardec up


def _stack(args, workdir: Path, settings, tls, internal_tls, tokens_file, http_addr, http_options, template):
    """The Stack ``pardec up``'s flags describe (not started)."""
    from pardec.gateway.stack import Stack

    return Stack(
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
            gateway_flags=("--overlap-drafting", args.overlap_drafting, *(http_options.flags() if http_addr else ()),
                           *(("--max-model-len", str(args.max_model_len)) if args.max_model_len is not None else ()),
                           *(("--enable-log-requests",) if args.enable_log_requests else ()),
                           *(("--disable-log-stats",) if args.disable_log_stats else ()),
                           *(("--otlp-traces-endpoint", args.otlp_traces_endpoint) if args.otlp_traces_endpoint else ())),
            verifier_flags=(*(("--no-prefix-caching",) if args.no_prefix_caching else ()),
                            "--kv-cache-dtype", args.kv_cache_dtype, "--embedding-dtype", args.embedding_dtype,
                            *(("--otlp-traces-endpoint", args.otlp_traces_endpoint) if args.otlp_traces_endpoint else ()),
                            "--generation-config", os.path.abspath(args.generation_config)
                            if args.generation_config not in GENERATION_SETTINGS else args.generation_config,
                            *(("--chat-template", _write_private_text(workdir / "chat_template.jinja", template))
                              if template else ())),
    )


def _write_private_json(path: Path, value) -> str:
    """The gateway gets its tokens through a 0600 file, never on a command line (ps shows those)."""
    return _write_private_text(path, json.dumps(value))


def _write_private_text(path: Path, text: str) -> str:
    """A 0600 file of ``text`` (the verifiers read a chat template from one: any form it was given in)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
    return str(path)
