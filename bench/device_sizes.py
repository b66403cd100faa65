"""The device engine at real model sizes, with random weights made on the GPU (random_models.py).

    python -m pardec.bench.device_sizes [--quick] [--shapes NAME ...] [--contexts N ...]
                                        [--gemm auto,cublas] [--out DIR] [--device cuda]

For each shape: the verifier's step cost (bench.device's step_costs: wall time, host packing and
the logits' copy included) for trees of 1, 4, 16 and 64 tokens in batches of 1, 8 and 32
sessions, at 512 and 2,048 cached positions; and plain decoding's step against its memory bound:
the int8 weight bytes plus the keys and values the row reads, over the copy bandwidth measured
here. For the bundled model's shape also where a 1-token and a 64-token step's GPU time goes
(bench.device's gpu_profile).

--gemm: the int8 products' choice (verifier/kernels/triton_int8_gemm.py GEMM), a comma list to
measure each shape under each, side by side; what auto chose per product shape and the candidates'
times are in the JSON. --quick: Llama-3-8B and Qwen2.5-7B, trees of 1, 16 and 64. Writes device_sizes.json and
device_sizes.md to --out (default bench/out) and prints the Markdown.
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

from pardec.bench.device import gpu_profile, step_costs, synchronize
from pardec.bench.random_models import SHAPES, kv_bytes_read, random_checkpoint, weight_bytes

FULL = dict(shapes=list(SHAPES), contexts=[512, 2048], trees=[1, 4, 16, 64], batches=[1, 8, 32], rounds=10)
QUICK = dict(shapes=["Llama-3-8B", "Qwen2.5-7B"], contexts=[512, 2048], trees=[1, 16, 64], batches=[1, 8, 32],
             rounds=8)


def copy_bandwidth(device, gib: float = 1.0) -> float:
    """Bytes read plus written per second by a device-to-device copy of `gib` GiB."""
    source = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            target.copy_(source)
        synchronize()
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * source.numel() * 4 / best


@torch.inference_mode()
def measure_shape(name: str, plan: dict, device: str, bandwidth: float) -> dict:
    from pardec.verifier.loading import load_model

    began = time.perf_counter()
    model = load_model(random_checkpoint(name, device), "w8a8", device=device, precondition=False, attention="triton")
    synchronize()
    weights = weight_bytes(model)
    result = {"build_s": round(time.perf_counter() - began, 1), "int8_weight_bytes": weights,
              "gpu_memory_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
              "step_ms": {}, "plain_step_vs_memory_bound": {}}
    print(f"{name}: built in {result['build_s']} s, {weights / 1e9:.2f} GB of int8 weights", flush=True)
    for context in plan["contexts"]:
        costs = step_costs(model, context, plan["trees"], plan["batches"], plan["rounds"], grid=True)
        result["step_ms"][str(context)] = {f"{t}x{b}": round(ms, 3) for (t, b), ms in costs.items()}
        bound_ms = (weights + kv_bytes_read(model.args, context)) / bandwidth * 1e3
        result["plain_step_vs_memory_bound"][str(context)] = {
            "step_ms": round(costs[1, 1], 3), "bound_ms": round(bound_ms, 3),
            "tokens_per_s": round(1e3 / costs[1, 1], 1), "bound_tokens_per_s": round(1e3 / bound_ms, 1)}
        print(f"  {context} positions: " + ", ".join(f"{k} {v:.2f}" for k, v in result["step_ms"][str(context)].items())
              + f" ms; memory bound of a plain step {bound_ms:.2f} ms", flush=True)
    if name == "SmolLM2-135M" and torch.cuda.is_available():
        result["profiles"] = {str(tokens): gpu_profile(model, tokens=tokens) for tokens in (1, 64)}
    gemm = model.device_forward.gemm
    result["gemm_chosen"] = {"x".join(map(str, key)): config.text() if config else "cublas"
                             for key, config in gemm.chosen.items()}
    result["gemm_candidate_us"] = {"x".join(map(str, key)): times for key, times in gemm.timings.items()}
    del model
    gc.collect()  # the engine's buffers and graphs hold references in cycles: free them before the next shape
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def markdown(report: dict) -> str:
    lines = [f"# The device engine at real sizes, {report['date']}: {report['gpu']}", "",
             f"torch {report['torch']}, attention `{report['attention_tuning']}`, command `{report['command']}`; "
             f"copy bandwidth {report['copy_bandwidth_gb_s']} GB/s (read + written)", ""]
    for name, shape in report["shapes"].items():
        if "error" in shape:
            lines += [f"## {name}", "", f"failed: {shape['error']}", ""]
            continue
        lines += [f"## {name} (random weights, W8A8 round-to-nearest; {shape['int8_weight_bytes'] / 1e9:.2f} GB "
                  f"int8 weights, {shape['gpu_memory_gib']} GiB on the GPU after the build)", ""]
        for context, costs in shape["step_ms"].items():
            batches = sorted({int(k.split("x")[1]) for k in costs})
            trees = sorted({int(k.split("x")[0]) for k in costs})
            bound = shape["plain_step_vs_memory_bound"][context]
            lines += [f"**{context} cached positions**, ms a step (tokens per session x sessions); plain decoding "
                      f"{bound['tokens_per_s']} tok/s against a memory bound of {bound['bound_tokens_per_s']} "
                      f"({bound['step_ms']} ms against {bound['bound_ms']} ms)", "",
                      "| tokens \\ sessions | " + " | ".join(map(str, batches)) + " |", "|---" * (len(batches) + 1) + "|"]
            for t in trees:
                lines.append(f"| {t} | " + " | ".join(f"{costs[f'{t}x{b}']:.2f}" if f"{t}x{b}" in costs else ""
                                                    for b in batches) + " |")
            lines.append("")
        if shape.get("gemm_chosen"):
            lines += ["int8 products (rows x K x N: chosen): " + ", ".join(
                f"{key} {chosen}" for key, chosen in shape["gemm_chosen"].items()), ""]
        for tokens, profile in shape.get("profiles", {}).items():
            lines += [f"Where a {tokens}-token step at 512 positions goes: graph replay {profile['graph_replay_gpu_ms']} "
                      f"ms of GPU; eager kernels by time ({profile['eager_kernel_total_us']} us):", "",
                      "| kernel | calls | us |", "|---|---:|---:|"]
            lines += [f"| `{k}` | {v['calls']} | {v['total_us']} |" for k, v in profile["eager_kernel_us"].items()]
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    parser.add_argument("--contexts", nargs="*", type=int)
    parser.add_argument("--gemm", default="auto", help="comma list of auto, cublas or a tiling")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    from pardec.bench.device import tuning_text
    from pardec.verifier.kernels import triton_attention, triton_int8_gemm

    choices = args.gemm.split(",")
    for choice in choices:
        triton_int8_gemm.parse_gemm(choice)

    plan = dict(QUICK if args.quick else FULL)
    if args.shapes:
        plan["shapes"] = args.shapes
    if args.contexts:
        plan["contexts"] = args.contexts
    began = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)
    report = {"date": datetime.date.today().isoformat(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else args.device,
              "torch": torch.__version__, "attention_tuning": tuning_text(triton_attention.ATTENTION_TUNING),
              "command": "python -m pardec.bench.device_sizes " + " ".join(argv if argv is not None else sys.argv[1:]),
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "plan": plan, "shapes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, choice in [(name, choice) for name in plan["shapes"] for choice in choices]:
        label = name if len(choices) == 1 else f"{name}, gemm {choice}"
        triton_int8_gemm.GEMM = choice
        try:
            report["shapes"][label] = measure_shape(name, plan, args.device, bandwidth)
        except Exception as error:  # one shape failing (memory, a kernel) must not lose the others
            print(f"{label} failed: {error!r}", flush=True)
            report["shapes"][label] = {"error": repr(error)}
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        report["seconds"] = round(time.perf_counter() - began, 1)
        # After each shape, so a run cut short keeps what it measured.
        (out / "device_sizes.json").write_text(json.dumps(report, indent=1) + "\n")
        text = markdown(report)
        (out / "device_sizes.md").write_text(text)
    print(text, flush=True)
    print(f"done in {report['seconds']} s", flush=True)
    return 0 if all("error" not in shape for shape in report["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
