"""python -m verifier: run one verifier on its own (deployments, `pardec up`)."""

from __future__ import annotations

import argparse

from pardec.serving import configure_logging, start_server, wait_for_termination, write_ready_file
from verifier.config import VerifierConfig
from verifier.server import build_servicer


def parse_args(argv=None) -> argparse.Namespace:
    defaults = VerifierConfig()
    parser = argparse.ArgumentParser(prog="python -m verifier", description="pardec verifier")
    parser.add_argument("--addr", default="127.0.0.1:50053", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument("--model", dest="model_path", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", default=defaults.quantization)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    parser.add_argument("--max-input-tokens", type=int, default=defaults.max_input_tokens)
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    config = VerifierConfig(
        model_path=args.model_path,
        quantization=args.quantization,
        device=args.device,
        max_seq_len=args.max_seq_len,
        max_input_tokens=args.max_input_tokens,
        max_sessions=args.max_sessions,
        threads=args.threads,
    )
    servicer = build_servicer(config)
    server, address = start_server([servicer.add_to], args.addr)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)


if __name__ == "__main__":
    main()
