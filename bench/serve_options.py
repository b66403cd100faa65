"""`pardec bench serve`'s flags, checked before anything is sent: each refusal names the flag and
the rule (bench/serve.py runs the benchmark)."""

from __future__ import annotations

import argparse
import json
import math
import os

from pardec.bench import workloads as workload_data
from pardec.bench.endpoint_client import ENDPOINTS, Target
from pardec.bench.arrivals import arrival_offsets

DESCRIPTION = "a running OpenAI-compatible server under the load its users put on it, measured from outside"
# What the benchmark's own flags set in every body; n > 1 would also interleave choices in one stream.
SLO_KEYS = ("ttft", "tpot", "e2el")
RESERVED = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream",
                      "stream_options", "temperature", "n", "best_of", "ignore_eos", "return_token_ids"})


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


def redacted(argv: list[str], key: str = "") -> list[str]:
    """The command line as it may be written down: the API key's value left out (``key``, the
    value, wherever it stands too).

    >>> redacted(["--api-key", "sk-1", "--api-key=sk-2", "--num-prompts", "4"])
    ['--api-key', '<redacted>', '--api-key=<redacted>', '--num-prompts', '4']
    """
    out = []
    for index, arg in enumerate(argv):
        if index and argv[index - 1] == "--api-key":
            out.append("<redacted>")
        elif arg.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(arg.replace(key, "<redacted>") if key else arg)
    return out


def parser() -> argparse.ArgumentParser:
    # No abbreviations: --api's value would not be found to leave out of the written command.
    parser = argparse.ArgumentParser(prog="pardec bench serve", description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server: http(s)://host:port[/v1]")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="chat: /v1/chat/completions, each prompt one user message; completions: /v1/completions")
    parser.add_argument("--model", default="", help="default: the server's first (GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("PARDEC_TOKEN", ""),
                        help="sent as a bearer token (default: $PARDEC_TOKEN, as the pardec command's --token)")
    parser.add_argument("--tls-ca", default="", help="a CA bundle for an https server the system's CAs do not sign")
    parser.add_argument("--workload", choices=(*workload_data.WORKLOADS, "random"), default="code_edit",
                        help="the prompts (bench/workloads.py; humaneval, mtbench, sharegpt need the `bench` extra); "
                             "random: --random-input-len tokens drawn at random (vLLM's random dataset)")
    parser.add_argument("--random-input-len", type=int, default=256,
                        help="--workload random's prompt length: token ids on completions, about as many tokens of "
                             "words on chat")
    parser.add_argument("--prompts-file", default="",
                        help='JSON lines, {"prompt": "...", "max_tokens": N (optional)}, instead of --workload')
    parser.add_argument("--num-prompts", type=int, default=16, help="requests a run (prompts repeat where fewer)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="answers of max_tokens each (vLLM's and pardec's)")
    parser.add_argument("--extra-body", default="",
                        help="a JSON object added to every request's body (not the fields the flags set)")
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


def settings(parser: argparse.ArgumentParser, args) -> tuple[Target, list[float], dict[str, float], dict]:
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--random-input-len", args.random_input_len, 1),
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
    reserved = sorted(set(extra) & (RESERVED | ({"parallel_decoding"} if args.compare_plain else set())))
    if reserved:
        parser.error(f"--extra-body: {', '.join(reserved)} are set by the benchmark (its flags say how), not here")
    try:
        slo = parse_goodput(args.goodput)
        arrival_offsets(0, args.request_rate, args.burstiness)
        target = Target(args.base_url, args.endpoint, args.model, args.api_key, args.timeout_s, args.tls_ca)
    except ValueError as error:
        parser.error(str(error))
    extra = {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {}),
             **({"return_token_ids": True} if args.compare_plain else {}), **extra}
    return target, percentiles, slo, extra
