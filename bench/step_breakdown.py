"""Where a decoding step's time goes through the stack, plain against parallel modes.

    python -m pardec.bench.step_breakdown --mode md16-dynamic --workload mtbench [--prompts 8] [--rounds 2]
    python -m pardec.bench.step_breakdown --mode md16+serial,md16+overlap --workload code_edit [--device cuda]

Starts a stack for the mode (as `pardec bench` does), runs the prompts once plain (a warm-up),
then `--rounds` rounds of plain and parallel in alternating order, and sums the gateway's
per-request stats (DecodingStats) per arm. Several modes (a comma list) get a stack each, started
anew every round in alternating order, each with its own plain arm. Per decoding step it prints
the wall time after the first token, the verifier's forward (its own compute_ms), the drafter
calls as the gateway saw them, the gateway's own time, the draft nodes verified and accepted,
the tokens committed per millisecond of decoding (whose ratio between the arms is the decode
speedup), and the share of a step that is not the forward.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pardec.bench import workloads
from pardec.bench.run import round_order
from pardec.bench.stack import MODES, SUFFIXES, gateway_stub, launch_mode, request, split_mode

FIELDS = ("steps", "total_ms", "ttft_ms", "drafter_ms", "verifier_compute_ms", "gateway_ms", "draft_tokens",
          "accepted_draft_tokens")


def per_step(totals: dict) -> dict:
    """Per-step figures of an arm's summed stats.

    >>> per_step({"steps": 100, "total_ms": 1500.0, "ttft_ms": 100.0, "drafter_ms": 120.0,
    ...           "verifier_compute_ms": 1100.0, "gateway_ms": 20.0, "draft_tokens": 60,
    ...           "accepted_draft_tokens": 25})["tokens_per_ms"]
    0.0893
    >>> per_step({"steps": 100, "total_ms": 1500.0, "ttft_ms": 100.0, "drafter_ms": 120.0,
    ...           "verifier_compute_ms": 1100.0, "gateway_ms": 20.0, "draft_tokens": 60,
    ...           "accepted_draft_tokens": 25})["not_forward"]
    0.214
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
        "not_forward": round(1 - totals["verifier_compute_ms"] / decode_ms, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="md16-dynamic",
                        help=f"of {', '.join(MODES)}, optionally with {', '.join(SUFFIXES)}; several: a comma list")
    parser.add_argument("--workload", default="mtbench", choices=workloads.WORKLOADS)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="where the verifier runs the model (cpu, cuda, npu)")
    args = parser.parse_args(argv)
    modes = args.mode.split(",")
    try:
        for mode in modes:
            split_mode(mode)
    except ValueError as error:
        parser.error(str(error))
    root = Path(tempfile.mkdtemp(prefix="pardec-breakdown-"))
    prompts = workloads.load(args.workload, args.prompts)
    totals = {(mode, arm): dict.fromkeys(FIELDS, 0) for mode in modes for arm in ("plain", mode)}
    for turn in range(args.rounds if len(modes) > 1 else 1):
        for mode in modes if turn % 2 == 0 else modes[::-1]:
            rounds = 1 if len(modes) > 1 else args.rounds
            measure(root / f"{turn}-{mode}", mode, prompts, args.max_new_tokens, turn, rounds, totals, args.device)
    print("| mode | arm | steps | decode ms/step | forward ms | drafter ms | gateway ms | nodes | accepted | "
          "tokens/ms | not forward |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {key: per_step(arm_totals) for key, arm_totals in totals.items()}
    for (mode, arm), row in rows.items():
        print(f"| {mode} | {arm} | " + " | ".join(str(value) for value in row.values()) + " |")
    for mode in modes:
        print(f"{mode}: decode speedup {rows[mode, mode]['tokens_per_ms'] / rows[mode, 'plain']['tokens_per_ms']:.3f}x")
    return 0


def measure(
    workdir: Path, mode: str, prompts: list, max_new_tokens: int, turn: int, rounds: int, totals: dict, device: str
) -> None:
    """One stack for `mode`: a plain warm-up, then `rounds` rounds of its arms, added to `totals`."""
    workdir.mkdir(parents=True)
    with launch_mode(workdir, mode, device) as stack, gateway_stub(stack) as stub:
        for prompt in prompts:  # warm-up, not counted
            stub.Generate(request(prompt, True, max_new_tokens), timeout=600)
        for order in range(turn, turn + rounds):
            for arm in (mode if arm == "parallel" else arm for arm in round_order(order, False)):
                for prompt in prompts:
                    stats = stub.Generate(request(prompt, arm == "plain", max_new_tokens), timeout=600).stats
                    for name in FIELDS:
                        totals[mode, arm][name] += getattr(stats, name)


if __name__ == "__main__":
    sys.exit(main())
