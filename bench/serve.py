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

import importlib
import inspect
import json
import math
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pardec.bench import workloads as workload_data
from pardec.bench.arrivals import arrival_offsets
from pardec.bench.endpoint_client import Outcome, Target, body, get_json, send
from pardec.bench.serve_options import parser as make_parser, redacted, settings
from pardec.bench.serve_report import PARALLEL, PLAIN, compare, markdown

SERVED = "served"
ARMS = {PARALLEL: {}, PLAIN: {"parallel_decoding": False}}  # what each arm adds to a request


@dataclass(frozen=True)
class Prompt:
    text: str | tuple[int, ...]  # token ids: a completions prompt sent as they are
    max_tokens: int


# Token ids a random prompt draws from: below every supported tokenizer's vocabulary (32,000 and
# up), past the control and byte tokens at its start.
RANDOM_TOKENS = range(1000, 30000)


def random_prompts(count: int, length: int, endpoint: str, seed: int) -> list[Prompt]:
    """vLLM's random dataset: ``count`` prompts of ``length`` tokens drawn at random, as token ids
    for completions (exactly ``length``), as words of the standard library's documentation for
    chat (about ``length`` tokens: common words are one token or two)."""
    draw = random.Random(seed)
    if endpoint == "completions":
        return [Prompt(tuple(draw.choice(RANDOM_TOKENS) for _ in range(length)), 0) for _ in range(count)]
    words = sorted({word for module in ("argparse", "json", "logging") for word in re.findall(
        r"\b[a-z]{3,9}\b", inspect.getdoc(importlib.import_module(module)) or "")})
    return [Prompt(" ".join(draw.choice(words) for _ in range(max(1, length * 3 // 4))), 0) for _ in range(count)]


def load_prompts(workload: str, prompts_file: str, count: int, max_tokens: int, seed: int,
                 random_input_len: int = 0, endpoint: str = "chat") -> list[Prompt]:
    """``count`` prompts: the file's lines (``{"prompt": ..., "max_tokens": optional}``), random
    ones of ``random_input_len`` tokens, or a workload's, repeated in order where there are fewer."""
    if workload == "random" and not prompts_file:
        return [Prompt(p.text, max_tokens) for p in random_prompts(count, random_input_len, endpoint, seed)]
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
    done = [o if o is not None else Outcome(error="the request's thread ended without an outcome") for o in outcomes]
    return done, time.perf_counter() - start


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
    steps = [o for o in done if o.steps and o.output_tokens]
    methods: dict[str, int] = {}
    for outcome in done:
        if outcome.decoding_method:
            methods[outcome.decoding_method] = methods.get(outcome.decoding_method, 0) + 1
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
        # A step is a forward after the prefill, which made each answer's first token.
        "tokens_per_step": (round(sum(o.output_tokens - 1 for o in steps) / sum(o.steps for o in steps), 3)
                            if steps else None),
        "uncounted": sum(o.output_tokens is None for o in done),  # no usage and no token ids: no TPOT either
        "decoding_methods": methods,
    }
    if slo:
        good = [o for o in done if _meets(o, slo)]
        summary["goodput"] = round(len(good) / duration_s, 3) if duration_s else None
        summary["goodput_limits_ms"] = slo
    return summary


def _meets(outcome: Outcome, slo: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s, "e2el": outcome.e2e_s}
    # A one-token answer has no TPOT: that limit does not apply to it (an uncounted one fails it).
    return all((key == "tpot" and outcome.output_tokens == 1) or (measured[key] is not None and
                                                                  measured[key] * 1e3 <= limit)
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


def _first_model(target: Target) -> str:
    models = get_json(target, "models")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
        raise ConnectionError(f"{target.base_url} names no model (GET {target.path('models')}): give one with --model")
    return data[0]["id"]


def _decoding_warnings(arms: dict[str, dict]) -> list[str]:
    """Where pardec's usage says an arm was not decoded as the comparison assumes."""
    warnings = []
    plain = arms.get(PLAIN, {}).get("decoding_methods", {})
    if set(plain) - {"plain"}:
        warnings.append(f"the plain arm was not decoded plain ({plain}): the server ignored parallel_decoding: false")
    parallel = arms.get(PARALLEL, {}).get("decoding_methods", {})
    if parallel and set(parallel) == {"plain"}:
        warnings.append("the server decoded every request of the parallel arm plain (no parallel decoding configured)")
    return warnings


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    target, percentiles, slo, extra = settings(parser, args)
    try:
        out = Path(args.out) if args.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
        prompts = load_prompts(args.workload, args.prompts_file, args.num_prompts, args.max_tokens, args.seed,
                               args.random_input_len, args.endpoint)
        if not target.model:
            target = Target(**{**target.__dict__, "model": _first_model(target)})
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
        reference, seconds = run_arm(target, prompts, offsets, args.max_concurrency, {**extra, **ARMS[PLAIN]})
    for round_index in range(args.rounds):
        for arm in arms if round_index % 2 == 0 else arms[::-1]:
            print(f"round {round_index + 1}/{args.rounds}: {arm}...", file=sys.stderr)
            runs[arm].append(run_arm(target, prompts, offsets, args.max_concurrency, {**extra, **ARMS.get(arm, {})}))
    result = {"command": "pardec bench serve " + " ".join(redacted(argv, args.api_key)), "model": target.model,
              "settings": {**{k: v for k, v in vars(args).items() if k not in ("api_key", "percentiles")},
                           "percentiles": percentiles, "request_rate": str(args.request_rate)},
              "arms": {arm: summarize([o for outcomes, _ in runs[arm] for o in outcomes],
                                      sum(seconds for _, seconds in runs[arm]), percentiles, slo) for arm in arms}}
    if reference is not None:
        warmup = summarize(reference, seconds, percentiles)
        result["warmup"] = {key: warmup[key] for key in ("requests", "completed", "failed", "errors")}
    if args.compare_plain:
        result["comparison"] = compare(runs, finite_rate=math.isfinite(args.request_rate))
        result["warnings"] = _decoding_warnings(result["arms"])
    if args.temperature == 0 and (args.compare_plain or args.rounds > 1):
        measured = {f"{arm} round {index + 1}": outcomes for arm in arms
                    for index, (outcomes, _) in enumerate(runs[arm])}
        if reference is None:  # the first run is the reference
            reference = measured.pop(next(iter(measured)))
        result["identical"] = check_identical(reference, measured)
    report = markdown(result)
    print(report)
    if out:
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "results.md").write_text(report)
    failed = any(summary["failed"] for summary in (*result["arms"].values(), result.get("warmup", {"failed": 0})))
    return 1 if failed or result.get("identical", {}).get("different") or result.get("warnings") else 0


if __name__ == "__main__":
    sys.exit(main())
