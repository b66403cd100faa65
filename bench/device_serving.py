"""Serving on an accelerator, measured in one run: parallel decoding through the whole gRPC
stack, and peers on the same device.

    python -m pardec.bench.device_serving [--quick] [--device cuda] [--out DIR] [--modes M,...]
                                          [--shape Llama-3-8B|none] [--prompts N] [--max-new-tokens N]

1. The stack `pardec up` starts (Redis, a drafter, the verifier on --device, the gateway) on the
   code-editing prompts, once per mode (--modes; by default md16 with drafting ahead off, `+serial`,
   and on, `+overlap`), each on a stack of its own with its own plain arm, arms alternating by round.
   Per arm: tokens/s of decoding (after the first token) and end to end through gRPC, and per
   step the forward, the drafter's wait and the share that is not the forward
   (bench.step_breakdown's per_step). Every output is compared with plain decoding's.
2. transformers on the same device and prompts (bf16 on a GPU): plain and prompt lookup (k=10),
   end to end, one prompt at a time, each after a warm-up.
3. One 7-8B shape's plain decoding step at 512 cached positions: transformers bf16 with random
   weights made from the architecture's config on the device, against pardec's W8A8 engine on the
   same shape (bench.device_sizes, random weights, round-to-nearest). `--shape none` skips it.

--quick: 4 prompts, one round, trees of 1 and 16 for pardec's shape. Writes device_serving.json and
device_serving.md to --out (default bench/out) after each part and prints the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

from pardec.bench import workloads
from pardec.bench.run import round_order
from pardec.bench.stack import gateway_stub, launch_mode, request
from pardec.bench.step_breakdown import FIELDS, per_step

MODES = ("md16+serial", "md16+overlap")


def serve(workdir: Path, mode: str, device: str, prompts: list[str], max_new_tokens: int, rounds: int) -> dict:
    """One stack for `mode` on `device`: plain once (the reference, not counted), then `rounds`
    rounds of plain and parallel in alternating order."""
    totals = {arm: dict.fromkeys(FIELDS, 0) for arm in ("plain", "parallel")}
    tokens = {"plain": 0, "parallel": 0}
    identical = True
    with launch_mode(workdir, mode, device) as stack, gateway_stub(stack) as stub:
        reference = [list(stub.Generate(request(p, True, max_new_tokens), timeout=600).token_ids) for p in prompts]
        for order in range(rounds):
            for arm in round_order(order, False):
                for prompt, expected in zip(prompts, reference):
                    reply = stub.Generate(request(prompt, arm == "plain", max_new_tokens), timeout=600)
                    identical &= list(reply.token_ids) == expected
                    tokens[arm] += len(reply.token_ids)
                    for name in FIELDS:
                        totals[arm][name] += getattr(reply.stats, name)
    result = {"identical_to_plain": identical}
    for arm, arm_totals in totals.items():
        row = per_step(arm_totals)
        row["decode_tok_s"] = round(row["tokens_per_ms"] * 1e3, 1)
        row["end_to_end_tok_s"] = round(tokens[arm] / arm_totals["total_ms"] * 1e3, 1)
        result[arm] = row
    result["decode_speedup"] = round(result["parallel"]["tokens_per_ms"] / result["plain"]["tokens_per_ms"], 3)
    result["end_to_end_speedup"] = round(result["parallel"]["end_to_end_tok_s"] / result["plain"]["end_to_end_tok_s"], 3)
    return result


def transformers_peers(device: str, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """transformers' generate on the bundled model: plain and prompt lookup, tokens/s end to end,
    each after a warm-up generation of its own (the device's context and kernels are not the peer's
    speed). Not its static cache: generate compiles the model for it, minutes before a token."""
    from pardec.bench.peers import load_transformers_model, measure_transformers

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_transformers_model().to(device=device, dtype=dtype)
    rows = {}
    for lookup in (None, 10):
        measure_transformers(model, prompt_ids[:1], 8, lookup, device=device)  # warm-up
        row = measure_transformers(model, prompt_ids, max_new_tokens, lookup, device=device)
        rows[row["peer"]] = {"tokens_per_s": row["tokens_per_s"], "tokens_per_step": row["tokens_per_step"]}
    del model
    _free(device)
    return {"dtype": str(dtype).removeprefix("torch."), "peers": rows}


def transformers_config(shape: str):
    """A transformers config of one of random_models.SHAPES."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from pardec.bench.random_models import SHAPES

    args = SHAPES[shape]
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(args.architecture, LlamaConfig)
    return config_class(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_position, tie_word_embeddings=args.tie_embeddings,
    )


@torch.inference_mode()
def transformers_step_ms(config, device: str, context: int = 512, new_tokens: int = 33) -> float:
    """Median ms of one greedy decoding step after a `context`-token prompt, for random weights
    of `config` made on `device` (bf16 on a GPU): generate(new_tokens) minus generate(1), over
    the new tokens after the first."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(device)

    def seconds(count: int) -> float:
        _synchronize(device)
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=count, min_new_tokens=count,
                       do_sample=False, pad_token_id=0)
        _synchronize(device)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    samples = sorted((seconds(new_tokens) - seconds(1)) / (new_tokens - 1) * 1e3 for _ in range(3))
    return samples[1]  # the model is freed with this frame (main's _free after it)


def pardec_step_ms(shape: str, device: str, trees: list[int]) -> dict:
    """pardec's W8A8 engine on the same shape: ms a step of each tree size at 512 positions."""
    from pardec.bench.device_sizes import copy_bandwidth, measure_shape

    plan = {"contexts": [512], "trees": trees, "batches": [1], "rounds": 5}
    measured = measure_shape(shape, plan, device, copy_bandwidth(device))
    _free(device)
    return {"step_ms": measured["step_ms"]["512"], "memory_bound": measured["plain_step_vs_memory_bound"]["512"]}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def markdown(report: dict) -> str:
    lines = [f"# Serving on {report['device_name']}, {report['date']}", "",
             f"torch {report['torch']}, command `{report['command']}`; {report['prompts']} code-editing prompts, "
             f"{report['max_new_tokens']} new tokens", "",
             "| mode | arm | decode tok/s | end-to-end tok/s | forward ms | drafter ms | not the forward | "
             "nodes | accepted | speedup (decode / end to end) | identical to plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for mode, result in report.get("stack", {}).items():
        for arm in ("plain", "parallel"):
            row = result[arm]
            speedup = f"{result['decode_speedup']}x / {result['end_to_end_speedup']}x" if arm == "parallel" else ""
            lines.append(f"| {mode} | {arm} | {row['decode_tok_s']} | {row['end_to_end_tok_s']} | {row['forward_ms']} | "
                         f"{row['drafter_ms']} | {row['not_forward']} | {row['nodes']} | {row['accepted']} | {speedup} | "
                         f"{result['identical_to_plain'] if arm == 'parallel' else ''} |")
    if "peers" in report:
        lines += ["", f"transformers ({report['peers']['dtype']}) on the same prompts, end to end:", "",
                  "| peer | tok/s | tokens per forward |", "|---|---:|---:|"]
        lines += [f"| {name} | {row['tokens_per_s']} | {row['tokens_per_step']} |"
                  for name, row in report["peers"]["peers"].items()]
    if "shape" in report:
        shape = report["shape"]
        lines += ["", f"{shape['name']}, random weights, plain decoding step at 512 cached positions: transformers "
                  f"({shape['transformers_dtype']}) {shape['transformers_step_ms']} ms"]
        if "pardec" in shape:
            lines[-1] += (f", pardec W8A8 {shape['pardec']['step_ms']} (ms by tokens x sessions; memory bound of a "
                          f"plain step {shape['pardec']['memory_bound']['bound_ms']} ms)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--shape", default="Llama-3-8B", help="a shape of bench.random_models.SHAPES, or none")
    parser.add_argument("--prompts", type=int, help="code-editing prompts (default 4 quick, 6 full)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of stack modes (bench.stack)")
    args = parser.parse_args(argv)
    from pardec.verifier.model.weights import load_checkpoint

    began = time.perf_counter()
    prompt_count = args.prompts or (4 if args.quick else 6)
    prompts = workloads.load("code_edit", prompt_count)
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "command": "python -m pardec.bench.device_serving " + " ".join(argv if argv is not None else sys.argv[1:]),
              "prompts": prompt_count, "max_new_tokens": args.max_new_tokens, "stack": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - began, 1)
        (out / "device_serving.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "device_serving.md").write_text(markdown(report))

    workdir = out / "device_serving_stacks"
    for turn, mode in enumerate(args.modes.split(",")):
        report["stack"][mode] = serve(workdir / f"{turn}", mode, args.device, prompts, args.max_new_tokens,
                                      1 if args.quick else 2)
        print(mode, json.dumps(report["stack"][mode]), flush=True)
        save()
    if not args.skip_peers:
        tokenizer = load_checkpoint(None).tokenizer
        report["peers"] = transformers_peers(args.device, [tokenizer.encode_chat(p) for p in prompts],
                                             args.max_new_tokens)
        print(json.dumps(report["peers"]), flush=True)
        save()
    if args.shape != "none":
        shape = {"name": args.shape, "transformers_dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
                 "transformers_step_ms": round(transformers_step_ms(transformers_config(args.shape), args.device), 3)}
        _free(args.device)
        report["shape"] = shape
        save()
        if args.device.startswith("cuda"):  # the engine's Triton kernels run interpreted elsewhere: too slow
            shape["pardec"] = pardec_step_ms(args.shape, args.device, [1, 16] if args.quick else [1, 4, 16, 64])
        print(json.dumps(shape), flush=True)
        save()
    text = markdown(report)
    print(text, flush=True)
    print(f"done in {report['seconds']} s", flush=True)
    identical = all(result["identical_to_plain"] for result in report["stack"].values())
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
