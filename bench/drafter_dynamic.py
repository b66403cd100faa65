"""dynamic_algo against fixed decoding lengths, end to end on the real model, mixed workload.

    python -m pardec.bench.drafter_dynamic [--lengths 4,8,16] [--rounds 2] [--max-new-tokens 64]

Two stacks run at once, idle but for the one being measured: one configured with
memory_decoding at decoding_length 16, whose requests lower it per request (GenerateRequest.draft:
the fixed lengths) or ask for plain decoding; one with dynamic_algo (bound 16). The prompts are
one of each workload of bench/workloads.py, run one at a time (concurrency 1; --concurrency to
change). Each round runs every configuration once, the order rotating from round to round; the
table gives each configuration's best round against plain's best, and checks every output
against plain's token for token. Tree sizing (gateway/tree_sizing.py) runs in every parallel
configuration: decoding_length or dynamic_algo's length only bounds the tree it may verify.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pardec.bench.load_curve import mixed_prompts, running_stack, run_batch
from pardec.v1 import gateway_pb2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.drafter_dynamic", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4,8,16", help="fixed decoding_length values, each <= 16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    prompts = mixed_prompts()
    lengths = [int(n) for n in args.lengths.split(",")]
    fixed = {"plain": None, **{f"fixed {n}": n for n in lengths}}
    names = [*fixed, "dynamic_algo (max 16)"]
    best: dict[str, object] = {}
    identical = {name: True for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        fixed_params = {"plugin_type": "memory_decoding", "decoding_length": 16}
        with running_stack(fixed_params, Path(tmp) / "fixed") as fixed_stack, \
                running_stack({**fixed_params, "dynamic_algo": True}, Path(tmp) / "dynamic") as dynamic_stack:  # fmt: skip
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    if name in fixed:
                        length = fixed[name]
                        draft = gateway_pb2.DraftOverrides(decoding_length=length) if length else None
                        batch = run_batch(
                            fixed_stack.stub, prompts, length is None, args.max_new_tokens, args.concurrency, draft
                        )
                    else:
                        batch = run_batch(dynamic_stack.stub, prompts, False, args.max_new_tokens, args.concurrency)
                    if name not in best or batch.tokens_per_s > best[name].tokens_per_s:
                        best[name] = batch
                    print(f"round {round_index + 1} {name}: {batch.tokens_per_s:.1f} tok/s",
                          file=sys.stderr, flush=True)  # fmt: skip
    for name in names:
        identical[name] = best[name].outputs == best["plain"].outputs
    plain = best["plain"].tokens_per_s
    print("| configuration | tok/s | vs plain | tokens/step | identical |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        batch = best[name]
        print(f"| {name} | {batch.tokens_per_s:.1f} | {batch.tokens_per_s / plain:.2f}x | "
              f"{batch.tokens / batch.steps:.2f} | {'yes' if identical[name] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
