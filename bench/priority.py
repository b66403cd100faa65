"""What a request's `priority` buys under contention: the time to the first token and the whole
latency of urgent requests (priority -1) against the same requests at the default priority, while
other clients keep the verifier busy with long prompts.

    python -m pardec.bench.priority [--background 8] [--probes 24] [--max-new-tokens 16] [--out DIR]

One stack (`pardec up`'s, memory_decoding with 16 draft tokens, the verifier's prefix cache off
so that every prompt is prefilled whole, the load governor off so that whether a step drafts does
not change during the run). ``--background`` clients each send one long prompt after
another (the retrieval passages of bench/workloads.py, plain decoding of --background-new-tokens):
their prefills share each forward's token budget (the verifier's max_batch_tokens), where the
engine serves lower priorities first. Meanwhile one probe client streams the longest code-editing
prompts, one request at a time, each prompt twice in a row, at priority -1 and at 0 (which first alternates), so both
classes meet the same prompts under the same load. The table gives each class's median and p90
time to the first token and latency, and the ratios of default to urgent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pardec.bench.stack import gateway_stub, launch, plugin_params, request
from pardec.bench.workloads import load

URGENT, DEFAULT = -1, 0


def probe(stub, prompt: str, priority: int, max_new: int) -> tuple[float, float]:
    """(time to the first token, latency) in ms of one streamed request."""
    asked = request(prompt, plain=False, max_new_tokens=max_new)
    asked.priority = priority
    start, first = time.perf_counter(), None
    for chunk in stub.GenerateStream(asked, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return 1e3 * ((first or end) - start), 1e3 * (end - start)


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def run(args) -> dict:
    background = load("retrieval", 10**9)  # the passages, a few hundred tokens each
    probes = sorted(load("code_edit", 10**9), key=len, reverse=True)[:args.probes]  # the longest code edits
    measured: dict[int, list[tuple[float, float]]] = {URGENT: [], DEFAULT: []}
    served, counting = {"background": 0, "errors": 0}, threading.Lock()
    with tempfile.TemporaryDirectory(prefix="pardec-priority-bench-") as tmp, \
            launch(Path(tmp) / "stack", plugin_params("md16"), verifier_flags=("--no-prefix-caching",),
                   gateway_flags=("--load-govern-from", "0")) as stack, \
            gateway_stub(stack) as stub:
        probe(stub, probes[0], DEFAULT, 4)  # warm
        stop = threading.Event()

        def client(index: int) -> None:
            turn = index
            while not stop.is_set():
                try:
                    stub.Generate(request(background[turn % len(background)], plain=True,
                                          max_new_tokens=args.background_new_tokens), timeout=600)
                    outcome = "background"
                except grpc.RpcError:
                    outcome = "errors"
                with counting:
                    served[outcome] += 1
                turn += args.background

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.background)]
        for thread in clients:
            thread.start()
        time.sleep(args.settle_s)  # every background client has a prompt in flight
        for index, prompt in enumerate(probes):
            for priority in ((URGENT, DEFAULT) if index % 2 == 0 else (DEFAULT, URGENT)):
                measured[priority].append(probe(stub, prompt, priority, args.max_new_tokens))
        stop.set()
        for thread in clients:
            thread.join(600)
    if served["errors"] or not served["background"]:
        raise RuntimeError(f"the background load did not hold: {served}")
    summary = {}
    for name, priority in (("urgent", URGENT), ("default", DEFAULT)):
        ttfts, latencies = ([sample[i] for sample in measured[priority]] for i in (0, 1))
        summary[name] = {"ttft_ms_p50": round(statistics.median(ttfts), 1), "ttft_ms_p90": round(_p90(ttfts), 1),
                         "latency_ms_p50": round(statistics.median(latencies), 1),
                         "latency_ms_p90": round(_p90(latencies), 1)}
    summary["default_over_urgent"] = {key: round(summary["default"][key] / summary["urgent"][key], 2)
                                      for key in summary["urgent"]}
    config = {name: getattr(args, name) for name in ("background", "probes", "max_new_tokens",
                                                     "background_new_tokens", "settle_s")}
    return {"config": config, "summary": summary, "served": served,
            "samples_ms": {str(priority): samples for priority, samples in measured.items()}}


def markdown(result: dict) -> str:
    rows = ["| class | TTFT p50 ms | TTFT p90 ms | latency p50 ms | latency p90 ms |", "|---|---:|---:|---:|---:|"]
    for name in ("urgent", "default", "default_over_urgent"):
        row = result["summary"][name]
        rows.append(f"| {name.replace('_', ' ')} | {row['ttft_ms_p50']} | {row['ttft_ms_p90']} | "
                    f"{row['latency_ms_p50']} | {row['latency_ms_p90']} |")
    config = result["config"]
    return (f"{config['probes']} prompts x 2 classes beside {config['background']} background clients "
            f"({result['served']['background']} background requests served, {result['served']['errors']} "
            "errors)\n\n" + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.priority", description=__doc__.splitlines()[0])
    parser.add_argument("--background", type=int, default=8, help="clients sending long prompts all along")
    parser.add_argument("--background-new-tokens", type=int, default=2,
                        help="few: the background clients are prefilling nearly all the time")
    parser.add_argument("--probes", type=int, default=24, help="prompts sent at both priorities (26 at most)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="each probe's")
    parser.add_argument("--settle-s", type=float, default=5.0, help="background load before the first probe")
    parser.add_argument("--out", help="directory for results.json and results.md")
    args = parser.parse_args(argv)
    result = run(args)
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
