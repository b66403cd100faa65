"""Where a decoding step's time goes through the stack, plain against a parallel mode.

    python -m pardec.bench.step_breakdown --mode md16-dynamic --workload mtbench [--prompts 8] [--rounds 2]

Starts a stack for the mode (as `pardec bench` does), runs the prompts once plain (a warm-up),
then `--rounds` rounds of plain and parallel in alternating order, and sums the gateway's
per-request stats (DecodingStats) per arm. Per decoding step it prints the wall time after the
first token, the verifier's forward (its own compute_ms), the drafter calls as the gateway saw
them, the gateway's own time, and the draft nodes verified and accepted; the last column is the
tokens committed per millisecond of decoding, whose ratio between the arms is the decode speedup.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pardec.bench import workloads
from pardec.bench.run import round_order
from pardec.bench.stack import EMBEDDED, MODES, SHARED, gateway_stub, launch_mode, request, split_mode

FIELDS = ("steps", "total_ms", "ttft_ms", "drafter_ms", "verifier_compute_ms", "gateway_ms", "draft_tokens",
          "accepted_draft_tokens")


def per_step(totals: dict) -> dict:
    """Per-step figures of an arm's summed stats.

    >>> per_step({"steps": 100, "total_ms": 1500.0, "ttft_ms": 100.0, "drafter_ms": 120.0,
    ...           "verifier_compute_ms": 1100.0, "gateway_ms": 20.0, "draft_tokens": 60,
    ...           "accepted_draft_tokens": 25})["tokens_per_ms"]
    0.0893
    """
    steps, decode_ms = totals["steps"], totals["total_ms"] - totals["ttft_ms"]
    return {
        "steps": steps,
        "decode_ms": round(decode_ms / steps, 2),
        "forward_ms": round(totals["verifier_compute_ms"] / steps, 2),
        "drafter_ms": round(totals["drafter_ms"] / steps, 2),
        "gateway_ms": round(totals["gateway_ms"] / steps, 2),
        "nodes": round(totals["draft_tokens"] / steps, 2),
        "accepted": round(totals["accepted_draft_tokens"] / steps, 2),
        "tokens_per_ms": round((steps + totals["accepted_draft_tokens"]) / decode_ms, 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="md16-dynamic",
                        help=f"of {', '.join(MODES)}, optionally with {SHARED} and {EMBEDDED}")
    parser.add_argument("--workload", default="mtbench", choices=workloads.WORKLOADS)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    try:
        split_mode(args.mode)
    except ValueError as error:
        parser.error(str(error))
    workdir = Path(tempfile.mkdtemp(prefix="pardec-breakdown-")) / "stack"
    workdir.mkdir(parents=True)
    prompts = workloads.load(args.workload, args.prompts)
    totals = {arm: dict.fromkeys(FIELDS, 0) for arm in ("plain", args.mode)}
    with launch_mode(workdir, args.mode) as stack, gateway_stub(stack) as stub:
        for prompt in prompts:  # warm-up, not counted
            stub.Generate(request(prompt, True, args.max_new_tokens), timeout=600)
        for turn in range(args.rounds):
            for arm in (args.mode if arm == "parallel" else arm for arm in round_order(turn, False)):
                for prompt in prompts:
                    stats = stub.Generate(request(prompt, arm == "plain", args.max_new_tokens), timeout=600).stats
                    for name in FIELDS:
                        totals[arm][name] += getattr(stats, name)
    rows = {arm: per_step(arm_totals) for arm, arm_totals in totals.items()}
    print("| arm | steps | decode ms/step | forward ms | drafter ms | gateway ms | nodes | accepted | tokens/ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm, row in rows.items():
        print(f"| {arm} | " + " | ".join(str(value) for value in row.values()) + " |")
    print(f"decode speedup: {rows[args.mode]['tokens_per_ms'] / rows['plain']['tokens_per_ms']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
