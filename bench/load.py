"""Load test: the real process stack under N concurrent clients, level after level.

Starts Redis, the verifier, a drafter and the gateway as processes (as `pardec up` does), warms
up, then at each concurrency level runs that many clients for a fixed time. Each client loops
over a mix of requests: parallel decoding, plain decoding, streaming, and multi-turn requests
that name a client session (drafting memory kept in Redis under a TTL); prompts are drawn from
the real workloads of bench/workloads.py. Reports per level throughput, p50/p99 latency and
time to first token, and errors by status (target: none); the RSS of every service process over
the run, growth measured from the end of the warm-up (target: flat); and the Redis keys left
once every session has ended, grouped by pattern with their TTLs (target: only TTL-bound
memory). The last level runs twice: RSS growth across the repeat, at a load the stack has
already seen, tells a leak from caches and pools filling up to that load's high-water mark.
Writes results.json and results.md to --out.

    python -m pardec.bench.load --concurrency 1,4,16,32 --duration-s 60 --out bench/out/load
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from pardec.bench import workloads as workload_data
from pardec.bench.stack import MODES, gateway_stub, launch
from pardec.v1 import gateway_pb2

KINDS = ("parallel", "plain", "stream", "conversation")


@dataclass(frozen=True)
class Sample:
    kind: str
    latency_s: float
    ttft_s: float
    tokens: int
    error: str = ""  # status code name; "" = success


def _request(kind: str, prompt: str, max_new: int, client: str) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new)
    if kind == "plain":
        request.decoding = gateway_pb2.DECODING_MODE_PLAIN
    if kind == "conversation":
        request.session_id = client
    return request


def one_request(stub, kind: str, prompt: str, max_new: int, client: str, timeout_s: float) -> Sample:
    request = _request(kind, prompt, max_new, client)
    start = time.perf_counter()
    try:
        if kind == "stream":
            ttft, tokens = None, 0
            for chunk in stub.GenerateStream(request, timeout=timeout_s):
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - start
                tokens += len(chunk.token_ids)
            return Sample(kind, time.perf_counter() - start, ttft or 0.0, tokens)
        reply = stub.Generate(request, timeout=timeout_s)
        return Sample(kind, time.perf_counter() - start, reply.stats.ttft_ms / 1e3, len(reply.token_ids))
    except grpc.RpcError as error:
        return Sample(kind, time.perf_counter() - start, 0.0, 0, error.code().name)


def run_level(stub, level: int, duration_s: float, prompts: list[str], max_new: int, timeout_s: float, seed: int):
    """``level`` clients, each sending one request after another until ``duration_s`` is over;
    requests in flight at the deadline finish and count. Returns (samples, wall seconds)."""
    samples: list[Sample] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        name = f"load-client-{seed}-{index}"
        turn = index
        while time.monotonic() < deadline:
            sample = one_request(stub, KINDS[turn % len(KINDS)], rng.choice(prompts), max_new, name, timeout_s)
            turn += 1
            with lock:
                samples.append(sample)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(level)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples, time.perf_counter() - start


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(level: int, samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if not s.error]
    latencies = [s.latency_s * 1e3 for s in ok]
    ttfts = [s.ttft_s * 1e3 for s in ok if s.ttft_s]
    tokens = sum(s.tokens for s in ok)
    by_kind = {kind: round(_pct([s.latency_s * 1e3 for s in ok if s.kind == kind], 50) or 0, 1) for kind in KINDS}
    return {
        "concurrency": level, "requests": len(samples), "wall_s": round(wall_s, 1),
        "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 2), "requests_per_s": round(len(ok) / wall_s, 3),
        "latency_ms_p50": _round(_pct(latencies, 50)), "latency_ms_p99": _round(_pct(latencies, 99)),
        "ttft_ms_p50": _round(_pct(ttfts, 50)), "ttft_ms_p99": _round(_pct(ttfts, 99)),
        "latency_ms_p50_by_kind": by_kind,
        "errors": dict(Counter(s.error for s in samples if s.error)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class RssSampler:
    """Samples VmRSS of each process every ``interval_s`` in a thread; ``mark`` labels a moment."""

    def __init__(self, pids: dict[str, int], interval_s: float):
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[dict] = []  # {"t": s, "mark": str|None, name: MiB}
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> dict[str, float]:
        values = {}
        for name, pid in self.pids.items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                values[name] = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
            except (OSError, AttributeError):
                values[name] = None
        return values

    def mark(self, label: str) -> dict:
        sample = {"t": round(time.monotonic() - self._start, 1), "mark": label, **self._read()}
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append({"t": round(time.monotonic() - self._start, 1), "mark": None, **self._read()})

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def memory_report(sampler: RssSampler, baseline: dict, end: dict, before_repeat: dict) -> dict:
    report = {}
    for name in sampler.pids:
        values = [s[name] for s in sampler.samples if s.get(name) is not None]
        start, final, repeat = baseline.get(name), end.get(name), before_repeat.get(name)
        known = start is not None and final is not None and repeat is not None
        report[name] = {
            "after_warmup_mib": _round(start), "end_mib": _round(final), "max_mib": _round(max(values, default=None)),
            "growth_mib": _round(final - start) if known else None,
            "growth_pct": _round(100 * (final - start) / start) if known and start else None,
            "growth_over_repeat_mib": _round(final - repeat) if known else None,
        }
    return report


def redis_keys(client: redis.Redis) -> list[dict]:
    """Every key left, grouped by pattern (the hash-tagged id replaced by {*}), with its TTLs."""
    groups: dict[str, dict] = defaultdict(lambda: {"count": 0, "types": set(), "ttl_s": []})
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        group = groups[re.sub(r"\{([^:}]*:)?[^}]*\}", r"{\1*}", name)]
        group["count"] += 1
        group["types"].add(client.type(key).decode())
        group["ttl_s"].append(client.ttl(key))
    return [
        {"pattern": pattern, "count": g["count"], "types": sorted(g["types"]),
         "without_ttl": sum(1 for t in g["ttl_s"] if t < 0),
         "ttl_s_min": min(g["ttl_s"]), "ttl_s_max": max(g["ttl_s"])}
        for pattern, g in sorted(groups.items())
    ]


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# Load test ({result['config']['mode']}, {result['config']['max_new_tokens']} new tokens, "
             f"{result['config']['duration_s']:.0f} s per level)", "",
             "| concurrency | requests | tok/s | req/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["levels"]:
        errors = ", ".join(f"{k} {v}" for k, v in row["errors"].items()) or "0"
        level = f"{row['concurrency']}{' (repeat)' if row['repeat'] else ''}"
        lines.append(f"| {level} | {row['requests']} | {row['tokens_per_s']} | {row['requests_per_s']} | "
                     f"{row['latency_ms_p50']} | {row['latency_ms_p99']} | {row['ttft_ms_p50']} | "
                     f"{row['ttft_ms_p99']} | {errors} |")
    lines += ["", "RSS (MiB) from the end of the warm-up to the end of the run; the last column is the growth",
              "over the repeat of the last level (a leak shows there; pools filling up to a load do not):", "",
              "| process | after warm-up | end | max | growth | growth over the repeat |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, row in result["memory"].items():
        lines.append(f"| {name} | {row['after_warmup_mib']} | {row['end_mib']} | {row['max_mib']} | "
                     f"{row['growth_mib']} ({row['growth_pct']}%) | {row['growth_over_repeat_mib']} |")
    lines += ["", "RSS (MiB) after each phase:", "", "| phase | " + " | ".join(result["memory"]) + " |",
              "|---|" + "---:|" * len(result["memory"])]
    for mark in result["rss_marks"]:
        lines.append(f"| {mark['mark']} | " + " | ".join(str(_round(mark.get(name))) for name in result["memory"]) + " |")
    lines += ["", "Redis keys left after every session ended:", "",
              "| pattern | keys | type | without TTL | TTL s (min..max) |", "|---|---:|---|---:|---|"]
    for row in result["redis_keys"]:
        lines.append(f"| `{row['pattern']}` | {row['count']} | {', '.join(row['types'])} | {row['without_ttl']} | "
                     f"{row['ttl_s_min']}..{row['ttl_s_max']} |")
    if not result["redis_keys"]:
        lines.append("| (none) | 0 | | | |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.load", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured time per level")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="at concurrency 4, before measuring")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", default="md16", choices=sorted(MODES), help="the server's parallel decoding")
    parser.add_argument("--workloads", default=",".join(workload_data.WORKLOADS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--rss-interval-s", type=float, default=1.0)
    parser.add_argument("--out", default="bench/out/load")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    prompts = [p for w in args.workloads.split(",") for p in workload_data.load(w, args.prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp, launch(Path(tmp) / "stack", MODES[args.mode]) as stack:
        store = redis.Redis.from_url(stack.redis_url)
        pids = {name: stack.process(name).pid for name in ("gateway", "verifier", "drafter-0")}
        pids["redis"] = int(store.info("server")["process_id"])
        with gateway_stub(stack) as stub, RssSampler(pids, args.rss_interval_s) as sampler:
            sampler.mark("started")
            log(f"warm-up: {args.warmup_s:.0f} s at concurrency 4")
            run_level(stub, 4, args.warmup_s, prompts, args.max_new_tokens, args.request_timeout_s, seed=0)
            baseline = sampler.mark("after warm-up")
            rows, marks = [], [baseline]
            for index, level in enumerate([*levels, levels[-1]]):
                samples, wall_s = run_level(stub, level, args.duration_s, prompts, args.max_new_tokens,
                                            args.request_timeout_s, seed=level + 1000 * (index == len(levels)))
                rows.append({**summarize(level, samples, wall_s), "repeat": index == len(levels)})
                marks.append(sampler.mark(f"after concurrency {level}" + " (repeat)" * rows[-1]["repeat"]))
                log(f"concurrency {level}: {rows[-1]['tokens_per_s']} tok/s, p50 {rows[-1]['latency_ms_p50']} ms, "
                    f"p99 {rows[-1]['latency_ms_p99']} ms, errors {rows[-1]['errors'] or 0}")
            end = sampler.mark("end")
        time.sleep(1.0)  # EndSession of the last requests is best effort after the reply
        result = {
            "config": vars(args), "prompts": len(prompts), "levels": rows,
            "memory": memory_report(sampler, baseline, end, before_repeat=marks[-2]), "rss_marks": marks,
            "rss_samples": sampler.samples,
            "redis_keys": redis_keys(store),
        }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, out / "results.md")
    print((out / "results.md").read_text())
    return 0


def log(message: str) -> None:
    print(f"[load] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
