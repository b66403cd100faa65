"""What the OpenAI-compatible HTTP API costs beside the gRPC API: the same requests through both.

    python -m pardec.bench.http_front [--prompts 4] [--rounds 3] [--max-new-tokens 128]

One stack (`pardec up`'s, memory_decoding with 16 draft tokens, greedy) serves both fronts. Each
prompt is streamed through gRPC `GenerateStream` and through `POST /v1/chat/completions` with
`stream: true` (a plain HTTP client reading the server-sent events, no SDK), in alternating order,
`--rounds` times. Both must return the same text (one core, lossless); the table gives the
medians of time to the first text and of tokens per second per front, and HTTP's ratio to gRPC.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

from pardec.bench.stack import gateway_stub, launch, plugin_params
from pardec.bench.workloads import load
from pardec.v1 import gateway_pb2


def _grpc(stub, prompt: str, max_new_tokens: int) -> tuple[str, float, float, int]:
    started, first, text, tokens = time.perf_counter(), None, [], 0
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=prompt)], max_new_tokens=max_new_tokens)
    for chunk in stub.GenerateStream(request, timeout=600):
        if chunk.text and first is None:
            first = time.perf_counter()
        text.append(chunk.text)
        tokens += len(chunk.token_ids)
    return "".join(text), first - started, time.perf_counter() - started, tokens


def _http(address: str, model: str, prompt: str, max_new_tokens: int) -> tuple[str, float, float, int]:
    host, port = address.rsplit(":", 1)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": max_new_tokens, "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    started, first, text, tokens = time.perf_counter(), None, [], 0
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()
    for line in reply:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            piece = choice["delta"].get("content") or ""
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
    connection.close()
    return "".join(text), first - started, time.perf_counter() - started, tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.http_front", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--workload", default="code_edit")
    args = parser.parse_args(argv)
    prompts = load(args.workload, args.prompts)
    runs: dict[str, list[tuple[float, float]]] = {"gRPC": [], "HTTP": []}
    with tempfile.TemporaryDirectory(prefix="pardec-http-bench-") as tmp:
        with launch(Path(tmp), plugin_params("md16"), http=True) as stack, gateway_stub(stack) as stub:
            model = stub.GetServedModel(gateway_pb2.GetServedModelRequest(), timeout=60).model
            for round_index in range(args.rounds):
                for index, prompt in enumerate(prompts):
                    order = ("gRPC", "HTTP") if (round_index + index) % 2 == 0 else ("HTTP", "gRPC")
                    texts = {}
                    for front in order:
                        if front == "gRPC":
                            text, ttft, total, tokens = _grpc(stub, prompt, args.max_new_tokens)
                        else:
                            text, ttft, total, tokens = _http(stack.http_address, model, prompt, args.max_new_tokens)
                        texts[front] = text
                        runs[front].append((ttft, tokens / total))
                    if texts["gRPC"] != texts["HTTP"]:
                        raise SystemExit(f"prompt {index}: the fronts returned different text")
    print(f"{args.workload}, {args.prompts} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, "
          "md16, greedy; texts identical on both fronts\n")
    print("| front | time to first text, median | tokens/s, median | ratio to gRPC (tokens/s) |")
    print("|---|---|---|---|")
    base = statistics.median(rate for _, rate in runs["gRPC"])
    for front, samples in runs.items():
        ttft = statistics.median(t for t, _ in samples)
        rate = statistics.median(r for _, r in samples)
        print(f"| {front} | {ttft * 1e3:.0f} ms | {rate:.1f} | {rate / base:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
