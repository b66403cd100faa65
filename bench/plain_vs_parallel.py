"""Plain vs memory_decoding through the real stack (gateway → drafter/Redis → verifier).

    python -m bench.plain_vs_parallel [--max-new-tokens 128] [--rounds 1]

Starts the stack as processes (as `pardec up` does), then runs each prompt in both modes
back to back, alternating, so the two are measured side by side on the same noisy machine.
Prints a Markdown table: tokens/s, speedup, mean accepted length, and whether the outputs
were token-identical.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import grpc

from gateway.mindie import load_mindie_config
from gateway.stack import Stack
from pardec.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS


def run(stub, prompt: str, plain: bool, max_new_tokens: int) -> gateway_pb2.GenerateResponse:
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return stub.Generate(
        gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, decoding=mode), timeout=1200
    )


def tokens_per_s(reply) -> float:
    return 1e3 * len(reply.token_ids) / reply.stats.total_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    workloads = [("code", p) for p in CODE_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), load_mindie_config(None), gateway_addr="127.0.0.1:0").start()
        try:
            with grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                run(stub, "Hello", True, 4)  # warm-up
                rows = []
                for kind, prompt in workloads:
                    plain_tps, parallel_tps, accepted, identical = [], [], [], True
                    for _ in range(args.rounds):
                        plain = run(stub, prompt, True, args.max_new_tokens)
                        parallel = run(stub, prompt, False, args.max_new_tokens)
                        plain_tps.append(tokens_per_s(plain))
                        parallel_tps.append(tokens_per_s(parallel))
                        accepted.append(parallel.stats.mean_accepted_length)
                        identical &= list(plain.token_ids) == list(parallel.token_ids)
                    rows.append((kind, prompt.splitlines()[0][:48], len(plain.token_ids),
                                 statistics.median(plain_tps), statistics.median(parallel_tps),
                                 statistics.median(accepted), identical))
        finally:
            stack.stop()
    print("| kind | prompt | tokens | plain tok/s | memory_decoding tok/s | speedup | mean accepted length | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for kind, title, count, plain, parallel, accepted, identical in rows:
        print(f"| {kind} | {title} | {count} | {plain:.1f} | {parallel:.1f} | {parallel / plain:.2f}x | {accepted:.2f} | {'yes' if identical else 'NO'} |")


if __name__ == "__main__":
    main()
