"""python -m pardec.verifier: run one verifier on its own (deployments, `pardec up`)."""

from __future__ import annotations

import argparse
import sys

from pardec.runtime.errors import ConfigError
from pardec.runtime.guards import add_allowed_clients_flag, parse_allowed_clients, server_guards
from pardec.runtime.limits import add_limit_flags, check_limits
from pardec.runtime.metrics import serve_metrics
from pardec.runtime.security import add_server_tls_flags, server_tls_from_flags
from pardec.runtime.serving import configure_logging, listening, start_server, wait_for_termination, write_ready_file
from pardec.verifier.config import (ATTENTION_KERNELS, EMBEDDING_DTYPES, KV_CACHE_DTYPES, VerifierConfig,
                                    read_chat_template)
from pardec.verifier.metrics import verifier_metrics
from pardec.verifier.server import build_servicer


def parse_args(argv=None) -> argparse.Namespace:
    defaults = VerifierConfig(measure_cost_curve=False)
    parser = argparse.ArgumentParser(prog="python -m pardec.verifier", description="pardec verifier")
    parser.add_argument("--addr", default="127.0.0.1:50053", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument("--model", dest="model_path", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default="",
                        help="the model's name in replies and the OpenAI API's model (default: the checkpoint's)")
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="a Jinja chat template file (or the template's text) served in place of the model's own")
    parser.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                        help="HTTP requests' default sampling: the model directory's generation_config.json, else its "
                             "config.json's (auto), "
                             "none, or the one in DIR")
    parser.add_argument("--quantization", default=defaults.quantization)
    parser.add_argument("--prepared-cache", dest="prepared_cache_dir", default=None, metavar="DIR",
                        help="where a float checkpoint's W8A8 preparation is kept after its first load "
                             "(default $XDG_CACHE_HOME/pardec or ~/.cache/pardec; '' : none, prepare at every start)")
    parser.add_argument("--device", default=defaults.device, help="cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--devices", help="comma list, one model worker per device (e.g. npu:0,npu:1); overrides --device")
    parser.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    parser.add_argument("--max-input-tokens", type=int, default=defaults.max_input_tokens)
    parser.add_argument("--max-tree-nodes", type=int, default=defaults.max_tree_nodes)
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions, help="per worker")
    parser.add_argument("--session-idle-s", type=float, default=defaults.session_idle_s)
    parser.add_argument("--admission-wait-s", type=float, default=defaults.admission_wait_s,
                        help="how long a prompt may wait for KV cache room before RESOURCE_EXHAUSTED (0: refuse at once)")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                        help="tokens per forward across sessions (continuous batching)")
    parser.add_argument("--max-batch-sessions", type=int, default=defaults.max_batch_sessions,
                        help="sessions per forward; 1 = no batching")
    parser.add_argument("--batch-wait-ms", type=float, default=defaults.batch_wait_ms,
                        help="longest wait for other sessions' steps to join a forward")
    parser.add_argument("--batch-wait-share", type=float, default=defaults.batch_wait_share,
                        help="that wait as a share of the previous forward's time, at most")
    parser.add_argument("--kv-pool-tokens", type=int, default=defaults.kv_pool_tokens, help="KV cache positions, per worker")
    parser.add_argument("--kv-block-tokens", type=int, default=defaults.kv_block_tokens)
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="compute every prompt whole, even when an earlier one started the same way")
    parser.add_argument("--no-cost-curve", dest="measure_cost_curve", action="store_false",
                        help="skip measuring the step cost curve at startup")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--fixed-threads", dest="adapt_threads", action="store_false",
                        help="every forward on all --threads; by default a forward runs on fewer when that is faster "
                             "(CPUs shared with other busy processes)")
    parser.add_argument("--otlp-traces-endpoint", default="",
                        help="send a span per Prefill to this OpenTelemetry collector (OTLP/gRPC HOST:PORT or URL)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
                        help="what the KV pool stores: auto (fp32 on CPU, bf16 in the device engine), bfloat16 "
                             "(half the memory per token on CPU), float32 (not in the device engine)")
    parser.add_argument("--embedding-dtype", choices=EMBEDDING_DTYPES, default=defaults.embedding_dtype,
                        help="what the embedding table is kept in: auto (bf16 or fp16 where that is exact: a checkpoint "
                             "used as stored; else fp32), bfloat16 (half a prepared table's memory, each entry rounded), "
                             "float32")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default=defaults.attention,
                        help="auto: the fp32 fixed-order C kernel on CPU when a compiler builds it, the device "
                             "engine (triton) on CUDA, else fp64")
    add_server_tls_flags(parser, "the verifier's port")
    add_allowed_clients_flag(parser, "the verifier")
    add_limit_flags(parser, "verifier")
    parser.add_argument("--metrics-addr", help="Prometheus metrics at HOST:PORT/metrics (port 0 = any free port)")
    parser.add_argument("--metrics-ready-file", help="write the metrics endpoint's bound address here")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    return VerifierConfig(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        chat_template=read_chat_template(args.chat_template),
        generation_config=args.generation_config,
        quantization=args.quantization,
        prepared_cache_dir=args.prepared_cache_dir,
        device=args.device,
        devices=tuple(d.strip() for d in args.devices.split(",") if d.strip()) if args.devices else (),
        max_seq_len=args.max_seq_len,
        max_input_tokens=args.max_input_tokens,
        max_tree_nodes=args.max_tree_nodes,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle_s,
        admission_wait_s=args.admission_wait_s,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_sessions=args.max_batch_sessions,
        batch_wait_ms=args.batch_wait_ms,
        batch_wait_share=args.batch_wait_share,
        kv_pool_tokens=args.kv_pool_tokens,
        kv_block_tokens=args.kv_block_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        embedding_dtype=args.embedding_dtype,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        measure_cost_curve=args.measure_cost_curve,
        prefix_caching=args.prefix_caching,
        threads=args.threads,
        adapt_threads=args.adapt_threads,
        attention=args.attention,
        tls=server_tls_from_flags(args),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = config_from_args(args)
        guards = server_guards(config.tls, parse_allowed_clients(args.allowed_clients), "the verifier")
        check_limits(args.max_concurrent_rpcs)
        servicer = build_servicer(config)
    except ConfigError as error:
        # One line naming the setting and the rule; exit code 2 = cannot start as configured.
        print(f"pardec verifier: configuration error: {error}", file=sys.stderr)
        return 2
    registry, counting = verifier_metrics(servicer.engine)
    try:  # metrics first: a bind that fails leaves no gRPC server half started
        metrics_address = args.metrics_addr and listening(
            "--metrics-addr", args.metrics_addr, lambda: serve_metrics(registry, args.metrics_addr)[1])
        server, address = listening("--addr", args.addr, lambda: start_server(
            [servicer.add_to], args.addr, tls=config.tls, interceptors=[*guards, counting],
            max_concurrent_rpcs=args.max_concurrent_rpcs, what="verifier",
        ))
    except ConfigError as error:
        print(f"pardec verifier: configuration error: {error}", file=sys.stderr)
        return 2
    if metrics_address:
        write_ready_file(args.metrics_ready_file, metrics_address)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)
    if servicer.tracer is not None:
        servicer.tracer.shutdown()  # the last spans
    return 0


if __name__ == "__main__":
    sys.exit(main())
