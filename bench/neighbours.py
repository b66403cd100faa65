"""The verifier as a neighbour: a stack's plain decoding alone, beside a busy-loop process, and
beside a second stack serving at the same time, under thread policies side by side.

    python -m pardec.bench.neighbours [--policies fixed,adaptive] [--rounds 3] [--max-new-tokens 128]
                                      [--out DIR]

A policy (POLICIES) is the OpenMP environment the stack's processes start with and the flags its
verifier gets: "fixed" runs every forward on all threads (the verifier before engine/threads.py),
"adaptive" is the verifier's default (fewer threads when that is faster), the others are
alternatives measured on the way (libgomp's wait policy, its spin count, one thread). Every
policy gets two stacks (A and B), started one after the other; then, round-robin over the
policies so that drift hits all alike:

1. solo: A serves one plain streamed request at a time;
2. busy: the same beside one process spinning `while True: pass`;
3. pair: A and B each serve one request at the same time.

A rate is tokens/s after the first token (the stream's wall time), over every request of the
scenario. Writes neighbours.json and neighbours.md to --out and prints the Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pardec.bench.stack import MODES, gateway_stub, launch, request
from pardec.bench.workloads import load

# name -> (the OpenMP environment of the stack's processes, more verifier flags). Unset: libgomp's
# defaults (a thread spins 300,000 times at a barrier before it sleeps).
_UNSET = {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": None}
POLICIES = {
    "fixed": (_UNSET, ("--fixed-threads",)),  # every forward on all threads: the verifier before threads.py
    "adaptive": (_UNSET, ()),  # the verifier's default: fewer threads when that is faster (engine/threads.py)
    "passive": (_UNSET | {"OMP_WAIT_POLICY": "passive"}, ("--fixed-threads",)),  # sleep at once at a barrier
    "spin1k": (_UNSET | {"GOMP_SPINCOUNT": "1000"}, ("--fixed-threads",)),
    "1thread": (_UNSET | {"OMP_NUM_THREADS": "1"}, ("--fixed-threads",)),
}
REQUEST_TIMEOUT_S = 300.0


@contextlib.contextmanager
def environment(values: dict[str, str | None]):
    """os.environ with `values` set (None: unset) for what starts inside, restored after."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def stream_rate(stub, prompt: str, max_new_tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds from the first token to the end) of one plain stream."""
    first_at, tokens = None, 0
    for chunk in stub.GenerateStream(request(prompt, True, max_new_tokens), timeout=REQUEST_TIMEOUT_S):
        if chunk.token_ids and first_at is None:
            first_at = time.perf_counter()
            tokens -= 1  # the first token comes from the prefill
        tokens += len(chunk.token_ids)
    return tokens, time.perf_counter() - (first_at or time.perf_counter())


def serve(stack, prompts: list[str], max_new_tokens: int, out: list) -> None:
    with gateway_stub(stack) as stub:
        for prompt in prompts:
            out.append(stream_rate(stub, prompt, max_new_tokens))


def rate(samples: list[tuple[int, float]]) -> float:
    return round(sum(t for t, _ in samples) / max(1e-9, sum(s for _, s in samples)), 1)


def measure(stacks: dict, rounds: int, max_new_tokens: int) -> dict:
    prompts = load("humaneval", 2)
    for a, b in stacks.values():  # first requests build lazily made state; not measured
        serve(a, prompts, 8, [])
        serve(b, prompts, 8, [])
    samples = {(policy, scenario): [] for policy in stacks for scenario in ("solo", "busy", "pair A", "pair B")}
    for _ in range(rounds):
        for policy, (a, _) in stacks.items():
            serve(a, prompts[:1], max_new_tokens, samples[policy, "solo"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(rounds):
            for policy, (a, _) in stacks.items():
                serve(a, prompts[:1], max_new_tokens, samples[policy, "busy"])
    finally:
        busy.kill()
        busy.wait()
    for _ in range(rounds):
        for policy, (a, b) in stacks.items():
            threads = [threading.Thread(target=serve, args=(stack, prompts[1:2], max_new_tokens, samples[policy, name]))
                       for stack, name in ((a, "pair A"), (b, "pair B"))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    return {policy: {scenario: rate(samples[policy, scenario]) for scenario in ("solo", "busy", "pair A", "pair B")}
            for policy in stacks}


def markdown(report: dict) -> str:
    lines = [f"# The verifier as a neighbour, {report['date']}", "", f"`{report['command']}` on {report['cpus']} CPUs; "
             f"plain decoding, tokens/s after the first token, {report['rounds']} rounds, {report['max_new_tokens']} "
             "new tokens a request; stacks of every policy loaded in "
             + ", ".join(f"{k} {v} s" for k, v in report["load_s"].items()), "",
             "| policy | solo | beside a busy loop | beside a second stack (A, B) | busy / solo | pair / solo | solo / fixed's |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    today = report["rates"].get("fixed", {}).get("solo")
    for policy, r in report["rates"].items():
        pair = min(r["pair A"], r["pair B"])
        lines.append(f"| {policy} | {r['solo']} | {r['busy']} | {r['pair A']}, {r['pair B']} | "
                     f"{r['busy'] / r['solo']:.2f} | {pair / r['solo']:.2f} | "
                     f"{(r['solo'] / today) if today else float('nan'):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="fixed,adaptive")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench/out/neighbours")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {sorted(POLICIES)}")
    report = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens,
              "command": "python -m pardec.bench.neighbours " + " ".join(argv if argv is not None else sys.argv[1:]),
              "load_s": {}}
    with contextlib.ExitStack() as stacks_open:
        stacks = {}
        for policy in policies:
            pair = []
            for name in "AB":
                began = time.perf_counter()
                env, flags = POLICIES[policy]
                with environment(env):
                    pair.append(stacks_open.enter_context(
                        launch(out / f"{policy}-{name}", MODES["md16"], verifier_flags=flags)))
                report["load_s"][f"{policy} {name}"] = round(time.perf_counter() - began, 1)
                print(f"{policy} {name} loaded in {report['load_s'][f'{policy} {name}']} s", flush=True)
            stacks[policy] = tuple(pair)
        report["rates"] = measure(stacks, args.rounds, args.max_new_tokens)
    (out / "neighbours.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "neighbours.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
