"""What a predicted output (OpenAI's `prediction`; gateway/prediction.py) buys parallel decoding.

Two workloads, each prompt with the prediction a client would send:
- code editing (bench/workloads.py's code_edit: "add type hints and a docstring, return the
  whole function"): the prediction is the function as it is, OpenAI's own use of the field. The
  prompt holds that text too, so memory_decoding already drafts from it; the prediction adds a
  pointer that follows it position by position.
- MT-Bench, edited: the question asked again with a sentence added (EDIT); the prediction is
  the answer to the question as first asked, the previous version of the answer, which the
  prompt does not hold.

A stack is started as `pardec bench` starts one (memory_decoding, decoding_length 16); each
prompt runs plain, parallel, and parallel with its prediction, for --rounds rounds in rotating
order, so each speedup is a ratio taken side by side. Every answer must equal plain decoding's
token for token (greedy); the run stops otherwise.

    python -m pardec.bench.prediction --prompts 8 --rounds 2 --out bench/out/prediction
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pardec.bench.stack import gateway_stub, launch_mode
from pardec.bench.workloads import load
from pardec.v1 import gateway_pb2

ARMS = ("plain", "parallel", "predicted")
EDIT = " Please be precise."


def code_edits(count: int) -> list[tuple[str, str]]:
    """(prompt, the function it shows)."""
    return [(prompt, prompt.split("\n\n", 1)[1].rstrip("\n")) for prompt in load("code_edit", count)]


def edited(stub, count: int, max_new: int) -> list[tuple[str, str]]:
    """(the question with EDIT added, the plain answer to the question as first asked)."""
    plain = gateway_pb2.DECODING_MODE_PLAIN
    return [(question + EDIT, stub.Generate(gateway_pb2.GenerateRequest(
        prompt=question, max_new_tokens=max_new, decoding=plain), timeout=3600).text)
            for question in load("mtbench", count)]


def _request(prompt: str, arm: str, prediction: str, max_new: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new, prediction=prediction if arm == "predicted" else "",
        decoding=gateway_pb2.DECODING_MODE_PLAIN if arm == "plain" else gateway_pb2.DECODING_MODE_DEFAULT)


def measure(stub, items: list[tuple[str, str]], rounds: int, max_new: int) -> dict:
    """Per arm: tokens per second, tokens per step; the median of the rounds' speedups over plain;
    the predictions' tokens that appeared in the answers."""
    reference = {p: stub.Generate(_request(p, "plain", "", max_new), timeout=3600) for p, _ in items}  # warm-up
    tokens = {arm: 0 for arm in ARMS}
    seconds = {arm: 0.0 for arm in ARMS}
    steps = {arm: 0 for arm in ARMS}
    ratios = {arm: [] for arm in ARMS[1:]}
    appeared = predicted = 0
    for round_index in range(rounds):
        spent = {}
        order = ARMS[round_index % 3:] + ARMS[:round_index % 3]
        for arm in order:
            start = time.perf_counter()
            for prompt, prediction in items:
                reply = stub.Generate(_request(prompt, arm, prediction, max_new), timeout=3600)
                if list(reply.token_ids) != list(reference[prompt].token_ids):
                    raise SystemExit(f"{arm} output differs from plain decoding's")
                tokens[arm] += len(reply.token_ids)
                steps[arm] += reply.stats.steps + 1  # the prefill makes the first token
                if arm == "predicted":
                    appeared += reply.stats.accepted_prediction_tokens
                    predicted += reply.stats.accepted_prediction_tokens + reply.stats.rejected_prediction_tokens
            spent[arm] = time.perf_counter() - start
            seconds[arm] += spent[arm]
        for arm in ARMS[1:]:
            ratios[arm].append(spent["plain"] / spent[arm])  # the same tokens every way
    return {
        **{f"{arm}_tok_s": round(tokens[arm] / seconds[arm], 2) for arm in ARMS},
        **{f"{arm}_speedup": round(statistics.median(ratios[arm]), 3) for arm in ARMS[1:]},
        **{f"{arm}_tokens_per_step": round(tokens[arm] / steps[arm], 3) for arm in ARMS},
        "tokens_per_answer": round(tokens["plain"] / rounds / len(items), 1),
        "prediction_tokens_appeared": f"{appeared}/{predicted}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench/out/prediction"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir, launch_mode(Path(workdir), "md16") as stack, \
            gateway_stub(stack) as stub:
        workloads = {"code_edit": code_edits(args.prompts), "mtbench_edited": edited(stub, args.prompts,
                                                                                    args.max_new_tokens)}
        results = {name: measure(stub, items, args.rounds, args.max_new_tokens) for name, items in workloads.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"prompts": args.prompts, "rounds": args.rounds, **results},
                                                      indent=2))
    lines = ["| workload | plain tok/s | parallel tok/s (speedup) | with the prediction (speedup) | tokens a step: "
             "plain / parallel / predicted | prediction tokens that appeared |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['plain_tok_s']} | {r['parallel_tok_s']} ({r['parallel_speedup']}x) | "
              f"{r['predicted_tok_s']} ({r['predicted_speedup']}x) | {r['plain_tokens_per_step']} / "
              f"{r['parallel_tokens_per_step']} / {r['predicted_tokens_per_step']} | {r['prediction_tokens_appeared']} |"
              for name, r in results.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
