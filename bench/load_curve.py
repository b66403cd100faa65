"""Throughput of parallel against plain decoding as concurrency grows, through the real stack.

    python -m pardec.bench.load_curve [--modes md16,la-4-5-5] [--concurrency 1,4,16,32] [--rounds 3]

One stack per mode (Redis, verifier, drafter, gateway as processes, configured by a MindIE
config.json as `pardec bench` does). The workload is mixed: one prompt of each workload of
bench/workloads.py, repeated to fill the concurrency. At each concurrency every round runs a
plain batch and a parallel batch back to back, plain first in odd rounds and parallel first in
even ones, so that both see the same machine, after one uncounted parallel batch (the gateway's
load governor learns per load band, as a service that has run a while already has). A round's
ratio is parallel over plain tokens/s, and the table gives the median ratio with the lowest and
highest, and plain's own spread over the rounds (what the machine's noise alone does to one cell). Every parallel output is checked
token for token against plain's.

Wall-clock ratios on a shared machine move by several percent from round to round, so the
table also counts the CPU time the whole stack (every service and Redis, from /proc) spent per
token. Once the machine is saturated -- from 4 requests on, with 2 cores -- throughput is the
cores over that cost, so a lower CPU cost per token is more throughput, and it is far less
disturbed by whatever else runs. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pardec.bench import workloads as workload_data
from pardec.bench.run import round_order
from pardec.bench.stack import MODES, gateway_stub, launch, request
from pardec.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class Batch:
    """One batch of requests run together: tokens, wall time, steps, the outputs, and the CPU
    seconds the stack spent on it (0 when not measured)."""

    tokens: int
    wall_s: float
    steps: int
    outputs: list[list[int]]
    cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_s / self.tokens


@dataclass
class RunningStack:
    """A started stack's gateway stub, and the CPU seconds its processes have used so far."""

    stub: gateway_pb2_grpc.GatewayStub
    cpu_seconds: Callable[[], float]


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a live process, from /proc/<pid>/stat (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def running_stack(plugin_params: dict, workdir: Path):
    """A whole stack configured with these plugin_params, warmed up by one request."""
    with launch(workdir, plugin_params) as stack, gateway_stub(stack) as stub:
        stub.Generate(gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=4), timeout=600)  # warm-up
        pids = stack.pids()
        yield RunningStack(stub, lambda: sum(process_cpu_seconds(pid) for pid in pids.values()))


def run_batch(
    stub, prompts: list[str], plain: bool, max_new: int, concurrency: int, draft=None, cpu_seconds=lambda: 0.0
) -> Batch:
    """Runs every prompt with `concurrency` requests in flight."""
    def one(prompt):
        return stub.Generate(request(prompt, plain, max_new, draft), timeout=3600)

    cpu_before, start = cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, prompts))
    wall_s, cpu_s = time.perf_counter() - start, cpu_seconds() - cpu_before
    return Batch(
        sum(len(r.token_ids) for r in replies), wall_s, sum(r.stats.steps for r in replies),
        [list(r.token_ids) for r in replies], cpu_s,
    )


def mixed_prompts(per_workload: int = 1) -> list[str]:
    return [prompt for name in workload_data.WORKLOADS for prompt in workload_data.load(name, per_workload)]


@dataclass
class Comparison:
    """Plain and parallel batches of the same prompts, round by round."""

    plain: list[Batch]
    parallel: list[Batch]

    @property
    def ratios(self) -> list[float]:
        return [p.tokens_per_s / q.tokens_per_s for p, q in zip(self.parallel, self.plain)]

    @property
    def identical(self) -> bool:
        return all(batch.outputs == self.plain[0].outputs for batch in self.plain + self.parallel)

    def row(self, mode: str, concurrency: int) -> str:
        ratios, plain_rates = self.ratios, [batch.tokens_per_s for batch in self.plain]
        median = statistics.median
        cpu_plain = median(batch.cpu_ms_per_token for batch in self.plain)
        cpu_parallel = median(batch.cpu_ms_per_token for batch in self.parallel)
        steps = sum(batch.steps for batch in self.parallel)
        return (
            f"| {mode} | {concurrency} | {len(self.plain[0].outputs)} | {median(plain_rates):.1f} | "
            f"{median(batch.tokens_per_s for batch in self.parallel):.1f} | **{median(ratios):.2f}x** | "
            f"{min(ratios):.2f}–{max(ratios):.2f} | ±{(max(plain_rates) / min(plain_rates) - 1) * 50:.0f}% | "
            f"{cpu_plain:.0f} / {cpu_parallel:.0f} ({cpu_parallel / cpu_plain:.2f}x) | "
            f"{sum(batch.tokens for batch in self.parallel) / steps:.2f} | {'yes' if self.identical else 'NO'} |"
        )


HEADER = (
    "| mode | concurrency | requests | plain tok/s | parallel tok/s | ratio (median) | ratio range | "
    "plain's spread | CPU ms/token plain / parallel | tokens/step | identical |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def compare(
    running: RunningStack, prompts: list[str], max_new: int, concurrency: int, rounds: int, warmup: int = 1
) -> Comparison:
    """`warmup` parallel batches, not counted (the gateway's load governor learns per load band,
    as a running service has long done), then `rounds` plain/parallel pairs of batches, the
    order alternating every round."""
    for _ in range(warmup):
        run_batch(running.stub, prompts, False, max_new, concurrency)
    comparison = Comparison([], [])
    for round_index in range(rounds):
        for plain in (arm == "plain" for arm in round_order(round_index, False)):
            batch = run_batch(running.stub, prompts, plain, max_new, concurrency, cpu_seconds=running.cpu_seconds)
            (comparison.plain if plain else comparison.parallel).append(batch)
    return comparison


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.load_curve", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="md16,la-4-5-5", help=f"of {','.join(MODES)}")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-batches", type=int, default=1, help="uncounted parallel batches per concurrency")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts-per-workload", type=int, default=1)
    args = parser.parse_args(argv)
    prompts = mixed_prompts(args.prompts_per_workload)
    rows = [HEADER]
    with tempfile.TemporaryDirectory() as tmp:
        for index, mode in enumerate(args.modes.split(",")):
            with running_stack(MODES[mode], Path(tmp) / str(index)) as running:
                for level in (int(c) for c in args.concurrency.split(",")):
                    batch_prompts = (prompts * level)[: max(len(prompts), level)]
                    row = compare(
                        running, batch_prompts, args.max_new_tokens, level, args.rounds, args.warmup_batches
                    ).row(mode, level)
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
