"""Throughput of parallel against plain decoding as concurrency grows, through the real stack.

    python -m bench.load_curve [--modes md16,la-4-5-5] [--concurrency 1,4,16,32] [--rounds 2]

One stack per mode (Redis, verifier, drafter, gateway as processes, configured by a MindIE
config.json as `pardec bench` does). The workload is mixed: one prompt of each workload of
bench/workloads.py, repeated to fill the concurrency. At each concurrency, plain and parallel
batches alternate (plain first in odd rounds, parallel first in even ones) so that both see the
same machine; the table reports each mode's best round and the ratio, and every parallel output
is checked token for token against plain's. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import workloads as workload_data
from bench.run import MODES, mindie_config
from gateway.mindie import load_mindie_config
from gateway.stack import Stack
from pardec.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class Batch:
    """One batch of requests run together: tokens, wall time, steps, and the outputs."""

    tokens: int
    wall_s: float
    steps: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@contextmanager
def running_stack(plugin_params: dict, workdir: Path):
    """A stub of the gateway of a whole stack configured with these plugin_params."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.json"
    config_path.write_text(json.dumps(mindie_config(plugin_params)))
    stack = Stack(workdir, load_mindie_config(str(config_path)), gateway_addr="127.0.0.1:0",
                  config_path=str(config_path), log_level="WARNING").start()  # fmt: skip
    try:
        with grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            stub.Generate(gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=4), timeout=600)  # warm-up
            yield stub
    finally:
        stack.stop()


def run_batch(stub, prompts: list[str], plain: bool, max_new: int, concurrency: int, draft=None) -> Batch:
    """Runs every prompt with `concurrency` requests in flight."""
    decoding = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT

    def one(prompt):
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, decoding=decoding, draft=draft)
        return stub.Generate(request, timeout=3600)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, prompts))
    wall_s = time.perf_counter() - start
    return Batch(
        sum(len(r.token_ids) for r in replies), wall_s, sum(r.stats.steps for r in replies),
        [list(r.token_ids) for r in replies],
    )


def mixed_prompts(per_workload: int = 1) -> list[str]:
    return [prompt for name in workload_data.WORKLOADS for prompt in workload_data.load(name, per_workload)]


def side_by_side(stub, prompts: list[str], runs: dict, max_new: int, concurrency: int, rounds: int) -> dict:
    """Each run (name -> (plain, draft limits)) `rounds` times, interleaved, the order rotating
    every round; returns name -> the best Batch, and whether every output equals the first run's."""
    best: dict[str, Batch] = {}
    names = list(runs)
    identical = True
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            plain, draft = runs[name]
            batch = run_batch(stub, prompts, plain, max_new, concurrency, draft)
            if name != names[0] and names[0] in best:
                identical &= batch.outputs == best[names[0]].outputs
            if name not in best or batch.tokens_per_s > best[name].tokens_per_s:
                best[name] = batch
    return {"best": best, "identical": identical}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_curve", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="md16,la-4-5-5", help=f"of {','.join(MODES)}")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts-per-workload", type=int, default=1)
    args = parser.parse_args(argv)
    prompts = mixed_prompts(args.prompts_per_workload)
    rows = ["| mode | concurrency | requests | plain tok/s | parallel tok/s | ratio | tokens/step | identical |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for index, mode in enumerate(args.modes.split(",")):
            with running_stack(MODES[mode], Path(tmp) / str(index)) as stub:
                for level in (int(c) for c in args.concurrency.split(",")):
                    batch_prompts = (prompts * level)[: max(len(prompts), level)]
                    runs = {"plain": (True, None), mode: (False, None)}
                    result = side_by_side(stub, batch_prompts, runs, args.max_new_tokens, level, args.rounds)
                    plain, parallel = result["best"]["plain"], result["best"][mode]
                    row = (f"| {mode} | {level} | {len(batch_prompts)} | {plain.tokens_per_s:.1f} | "
                           f"{parallel.tokens_per_s:.1f} | {parallel.tokens_per_s / plain.tokens_per_s:.2f}x | "
                           f"{parallel.tokens / parallel.steps:.2f} | {'yes' if result['identical'] else 'NO'} |")
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
