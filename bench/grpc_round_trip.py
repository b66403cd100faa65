"""What a verify call's round trip costs over gRPC, a unary call against a message on a
bidirectional stream kept open (one per session), both on loopback with the product's server.

    python -m pardec.bench.grpc_round_trip [--calls 2000] [--rounds 5] [--nodes 16]

The server answers each VerifyRequest with a VerifyResponse of the tree's size at once (no
model), so what is timed is the transport: serialization, HTTP/2, gRPC's threads. Calls of the
two kinds alternate by round; the table gives the median microseconds per call over the rounds.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time

import grpc

from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import verifier_pb2

SERVICE = "pardec.bench.RoundTrip"


def answer(request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
    nodes = len(request.tree.token_ids)
    return verifier_pb2.VerifyResponse(
        accepted_token_ids=list(request.tree.token_ids[:2]), bonus_token_id=7, node_argmax=[3] * (nodes + 1),
        compute_ms=1.0,
    )


def register(server: grpc.Server) -> None:
    decode, encode = verifier_pb2.VerifyRequest.FromString, verifier_pb2.VerifyResponse.SerializeToString
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: answer(request), decode, encode),
        "Stream": grpc.stream_stream_rpc_method_handler(
            lambda requests, context: (answer(request) for request in requests), decode, encode
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def unary_us(channel: grpc.Channel, request, calls: int) -> float:
    call = channel.unary_unary(f"/{SERVICE}/Unary", request_serializer=type(request).SerializeToString,
                               response_deserializer=verifier_pb2.VerifyResponse.FromString)
    start = time.perf_counter()
    for _ in range(calls):
        call(request, timeout=10)
    return (time.perf_counter() - start) / calls * 1e6


def stream_us(channel: grpc.Channel, request, calls: int) -> float:
    """Ping-pong on one stream: each message is sent once the previous answer is in, as a
    session's steps would be."""
    call = channel.stream_stream(f"/{SERVICE}/Stream", request_serializer=type(request).SerializeToString,
                                 response_deserializer=verifier_pb2.VerifyResponse.FromString)
    outbox: queue.Queue = queue.Queue()
    responses = call(iter(outbox.get, None), timeout=60)
    outbox.put(request)  # the stream's first message opens it: not timed
    next(responses)
    start = time.perf_counter()
    for _ in range(calls):
        outbox.put(request)
        next(responses)
    elapsed = time.perf_counter() - start
    outbox.put(None)
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=16, help="draft nodes in each VerifyRequest")
    args = parser.parse_args(argv)
    server, address = start_server([register], "127.0.0.1:0")
    request = verifier_pb2.VerifyRequest(session_id="s" * 32)
    request.tree.token_ids.extend(range(1000, 1000 + args.nodes))
    request.tree.parents.extend(range(-1, args.nodes - 1))
    times: dict[str, list[float]] = {"unary": [], "stream": []}
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            unary_us(channel, request, 200), stream_us(channel, request, 200)  # warm-up
            for turn in range(args.rounds):
                for kind in ("unary", "stream") if turn % 2 == 0 else ("stream", "unary"):
                    run = unary_us if kind == "unary" else stream_us
                    times[kind].append(run(channel, request, args.calls))
    finally:
        server.stop(None)
    print(f"| transport | us per call (median of {args.rounds} rounds of {args.calls}) | rounds |")
    print("|---|---:|---|")
    for kind, samples in times.items():
        print(f"| {kind} | {statistics.median(samples):.0f} | {', '.join(f'{s:.0f}' for s in samples)} |")
    print(f"stream / unary: {statistics.median(times['stream']) / statistics.median(times['unary']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
